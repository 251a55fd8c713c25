"""Checkpoint file throughput: one rank's safetensors file saved and loaded, streamed against whole-state copies.

    python3 benchmarks/bench_checkpoint.py                                   # CPU, 4 GB in /dev/shm
    python3 benchmarks/bench_checkpoint.py --device cuda --gb 20 --repeats 2 --out benchmarks/results/bench_checkpoint_<tag>.json

A synthetic train state of --gb GB on --device, shaped like a rank's share of a K3 model: fp32 tensors of
--tensor-mb MB (masters and Adam moments, most of the bytes), bf16 tensors of an eighth of that, a few hundred
small fp32 vectors (router biases, norms) and int64 / 0-d scalars. Each save writes
`<dir>/rank_00000.safetensors` (default /dev/shm, where a RAM-backed save measures the copies, not a disk),
fsyncs it and computes its digest, as moontrain.checkpoint.save_checkpoint does (the sha256 of each 16 MiB
block on --threads threads, moontrain.checkpoint.digest; format v1 checkpoints have one whole-file sha256):

- save / whole-copy (the baseline, kept here only): every tensor copied to host memory (`.to("cpu", copy=True)`,
  pageable), safetensors.torch.save_file (which serializes the whole file in memory first), fsync, then the
  sha256 read back from the file;
- save / stream: moontrain's write_safetensors: header, then chunks through two reused staging buffers (pinned,
  filled on a side CUDA stream, for CUDA tensors; none for contiguous CPU tensors), each chunk's blocks hashed
  on the digest threads while it is written; fsync;
- save / stream-sha256: the same with one whole-file sha256 (format v1), hashed on one thread;
- save / stream-no-hash: the same without a digest, to show what the hash costs;
- load / copy: the whole-file sha256 check (format v1), then each tensor read into a fresh host tensor and
  copied into the destination tensor;
- load / read-into: the block digest check (as TensorSource does before reading, blocks read and hashed on
  the digest threads), then SafetensorsReader.read_into: a CPU destination is read into directly, a CUDA one
  through two pinned buffers (the copy of one chunk overlapping the read of the next);
- load / read-into-sha256: the same after a whole-file sha256 check (format v1).

Loads read into the state's own tensors (zeroed first; checked afterwards against checksums taken before the
first save). Reported: median seconds over --repeats, GB/s (1e9 bytes) and the peak extra host RSS of the
operation (VmHWM of /proc/self/status after resetting it through /proc/self/clear_refs, minus the RSS before).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from moontrain.checkpoint import digest
from moontrain.checkpoint.digest import BlockSha256, file_block_sha256
from moontrain.checkpoint.safetensors_io import SafetensorsReader, write_safetensors
from moontrain.checkpoint.store import FORMAT
from moontrain.checkpoint.tensors import file_sha256

METADATA = {"format": "pt", "moontrain": FORMAT}
FILE = "rank_00000.safetensors"


def synthetic_state(gb: float, tensor_mb: int, device: torch.device) -> dict[str, torch.Tensor]:
    """~gb * 1e9 bytes: 7/8 in fp32 tensors of tensor_mb MB, 1/8 in bf16 ones of tensor_mb / 8 MB, plus small ones."""
    total, state = int(gb * 1e9), {}
    pattern = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)).to(device)  # 16 MB of values

    def filled(n: int, dtype: torch.dtype, i: int) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=device)
        for lo in range(0, n, pattern.numel()):
            hi = min(n, lo + pattern.numel())
            t[lo:hi].copy_(pattern[:hi - lo] * (1 + i / 64))
        return t

    fp32_rows, bf16_rows = tensor_mb * 2**20 // 4 // 1024, tensor_mb * 2**20 // 8 // 2 // 1024
    layer = 0
    while sum(t.numel() * t.itemsize for t in state.values()) < total:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            state[f"model.layers.{layer}.experts.{kind}"] = filled(fp32_rows * 1024, torch.float32, layer).view(-1, 1024)
        state[f"model.layers.{layer}.attn.compute_bf16"] = filled(bf16_rows * 1024, torch.bfloat16, layer).view(-1, 1024)
        for j in range(20):
            state[f"model.layers.{layer}.norm{j}.weight"] = filled(1024, torch.float32, j)
        state[f"optim.layers.{layer}.step"] = torch.tensor(float(layer + 1), device=device)
        state[f"model.layers.{layer}.router.counts"] = torch.arange(384, dtype=torch.int64, device=device)
        layer += 1
    return state


def _checksum(t: torch.Tensor) -> int:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize]
    return int(t.reshape(-1).view(ints).sum(dtype=torch.int64)) if t.numel() else 0


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(next(line.split()[1] for line in fh if line.startswith(field + ":")))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fsync(path: Path) -> None:
    with path.open("rb+") as fh:
        os.fsync(fh.fileno())


def save_whole_copy(state: dict[str, torch.Tensor], path: Path) -> str:
    """The baseline: host copies of everything, then safetensors.torch.save_file, fsync, sha256 read back."""
    from safetensors.torch import save_file
    copies = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}
    save_file(copies, str(path), metadata=METADATA)
    del copies
    _fsync(path)
    return file_sha256(path)


def save_stream(state: dict[str, torch.Tensor], path: Path, *, hashed: str = "blocks") -> str:
    """hashed: "blocks" (the block digests, joined by commas), "sha256" (one whole-file sha256) or "" (none)."""
    entries = [(n, tuple(t.shape), t.dtype, lambda t=t: t) for n, t in state.items()]
    if hashed == "blocks":
        with BlockSha256() as blocks:
            write_safetensors(path, entries, metadata=METADATA, digest=blocks)
        _fsync(path)
        return ",".join(blocks.hexdigests())
    sha = hashlib.sha256() if hashed == "sha256" else None
    write_safetensors(path, entries, metadata=METADATA, digest=sha)
    _fsync(path)
    return sha.hexdigest() if sha is not None else ""


def load_copy(state: dict[str, torch.Tensor], path: Path) -> str:
    checksum = file_sha256(path)
    reader = SafetensorsReader(path)
    for name, t in state.items():
        t.copy_(reader.rows(name, 0, t.shape[0] if t.ndim else 0))
    reader.close()
    return checksum


def load_read_into(state: dict[str, torch.Tensor], path: Path, *, blocks: bool = True) -> str:
    checksum = ",".join(file_block_sha256(path)) if blocks else file_sha256(path)
    reader = SafetensorsReader(path)
    for name, t in state.items():
        reader.read_into(name, 0, t.shape[0] if t.ndim else 0, t)
    reader.close()
    return checksum


def measure(fn: Callable[[], str], device: torch.device, before: Callable[[], None]) -> tuple[float, float, str]:
    """(seconds, peak extra host RSS in GB, what fn returns) of one call, `before()` untimed."""
    before()
    _sync(device)
    rss0 = _rss_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    return seconds, (_rss_kib("VmHWM") - rss0) * 1024 / 1e9, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="state size in GB (1e9 bytes)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dir", help="where the file is written (default /dev/shm when it has room, else /tmp; "
                        "a RAM-backed dir measures the copies, not a disk)")
    parser.add_argument("--tensor-mb", type=int, default=256, help="size of the large fp32 tensors")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-baseline", action="store_true", help="leave out the whole-copy save and the copy load")
    parser.add_argument("--threads", type=int, default=digest.THREADS,
                        help=f"threads of the block digests (default min(8, cpus) = {digest.THREADS})")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    digest.THREADS = args.threads
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    need = int(args.gb * 1e9 * 1.05) + (64 << 20)
    if args.dir is None:
        args.dir = next((d for d in ("/dev/shm", "/tmp") if Path(d).is_dir() and _free_bytes(d) > need), "/tmp")
    if _free_bytes(args.dir) < need:
        raise SystemExit(f"--dir {args.dir} has {_free_bytes(args.dir) / 1e9:.1f} GB free, the file needs "
                         f"{need / 1e9:.1f} GB: pass a --dir with room or a smaller --gb")
    work = Path(args.dir) / f"bench_checkpoint_{os.getpid()}"
    work.mkdir(parents=True)
    path = work / FILE
    peak_resettable = _reset_peak()
    print(f"building a {args.gb} GB state on {device} ...", file=sys.stderr, flush=True)
    state = synthetic_state(args.gb, args.tensor_mb, device)
    nbytes = sum(t.numel() * t.itemsize for t in state.values())
    sums = {name: _checksum(t) for name, t in state.items()}

    def remove() -> None:
        path.unlink(missing_ok=True)

    def zero() -> None:
        for t in state.values():
            t.zero_()

    saves = {"whole-copy": save_whole_copy, "stream": save_stream,
             "stream-sha256": lambda s, p: save_stream(s, p, hashed="sha256"),
             "stream-no-hash": lambda s, p: save_stream(s, p, hashed="")}
    loads = {"copy": load_copy, "read-into": load_read_into,
             "read-into-sha256": lambda s, p: load_read_into(s, p, blocks=False)}
    if args.skip_baseline:
        del saves["whole-copy"], loads["copy"]
    rows = []
    try:
        for op, fns, before in (("save", saves, remove), ("load", loads, zero)):
            for variant, fn in fns.items():
                times, peaks = [], []
                for rep in range(args.repeats):
                    if op == "load" and not path.exists():
                        save_stream(state, path)
                    seconds, peak, got = measure(lambda fn=fn: fn(state, path), device, before)
                    times.append(seconds)
                    peaks.append(peak)
                    if variant == "stream" and got != ",".join(file_block_sha256(path)):
                        raise SystemExit("save stream: the block digests hashed while writing are not the file's")
                    if variant == "stream-sha256" and got != file_sha256(path):
                        raise SystemExit("save stream-sha256: the sha256 hashed while writing is not the file's")
                    print(f"  {op} {variant} repeat {rep}: {seconds:.2f} s, peak extra RSS {peak:.2f} GB",
                          file=sys.stderr, flush=True)
                    if op == "load":
                        bad = [n for n, t in state.items() if _checksum(t) != sums[n]]
                        if bad:
                            raise SystemExit(f"load {variant}: {len(bad)} tensors differ after the load, first {bad[0]}")
                median = statistics.median(times)
                rows.append({"op": op, "variant": variant, "gb": nbytes / 1e9, "median_s": median,
                             "gb_per_s": nbytes / 1e9 / median, "times_s": times, "peak_extra_rss_gb": max(peaks)})
            if op == "save":
                save_stream(state, path)  # the loads read a streamed file
    finally:
        remove()
        work.rmdir()
    print(f"\n{args.gb} GB state on {device}, {len(state)} tensors, file in {args.dir}, median of {args.repeats}, "
          f"{args.threads} digest threads")
    print(f"{'op':<6}{'variant':<18}{'GB':>7}{'median s':>10}{'GB/s':>8}{'peak extra RSS GB':>19}")
    for r in rows:
        print(f"{r['op']:<6}{r['variant']:<18}{r['gb']:>7.2f}{r['median_s']:>10.2f}{r['gb_per_s']:>8.2f}"
              f"{r['peak_extra_rss_gb']:>19.2f}")
    if not peak_resettable:
        print("note: /proc/self/clear_refs could not be written: peak RSS is the process's peak so far")
    if args.out:
        info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
                "cpus": os.cpu_count(), "digest_threads": args.threads, "block_bytes": digest.BLOCK_BYTES,
                "torch": torch.__version__, "dir": args.dir, "gb": args.gb,
                "tensor_mb": args.tensor_mb, "repeats": args.repeats, "num_tensors": len(state),
                "date": time.strftime("%Y-%m-%d")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": info, "results": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
