"""The streamed safetensors writer and the reader that reads into a destination tensor.

References: safetensors.torch.save_file on contiguous copies of the same tensors (the streamed file must be the
same bytes; with several metadata keys save_file's own key order varies from process to process, so there the
header must parse to the same JSON and the data section must be the same bytes), hashlib over the file's bytes
(the streamed sha256), and the saved tensors themselves (a read must return them bit for bit).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moontrain.checkpoint import store
from moontrain.checkpoint.safetensors_io import SafetensorsReader, host_chunks, write_safetensors
from moontrain.checkpoint.tensors import file_sha256
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    """Several dtypes, empty and 0-d tensors, and non-contiguous views (transposed, strided, sliced)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(24, 10, generator=g)
    state = {
        "w.fp32": torch.randn(7, 5, generator=g),
        "w.bf16": torch.randn(3, 33, generator=g).to(torch.bfloat16),
        "w.fp16": torch.randn(9, generator=g).to(torch.float16),
        "idx.i64": torch.randint(-2**40, 2**40, (6, 4), generator=g),
        "idx.i32": torch.randint(-2**30, 2**30, (5,), generator=g, dtype=torch.int32),
        "bytes.u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "mask.bool": torch.rand(11, generator=g) > 0.5,
        "fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "empty.fp32": torch.empty(0, 4),
        "empty.i64": torch.empty(0, dtype=torch.int64),
        "step": torch.tensor(7.0),
        "view.transposed": base.t(),  # [10, 24], strides (1, 10)
        "view.strided": base[::3, 1::2],  # [8, 5]
        "view.sliced_cols": base[:, 2:9].to(torch.bfloat16)[:, ::2],  # bf16, non-contiguous
        "view.rows": base[5:17],  # contiguous view with a storage offset
    }
    return {k: v.to(device) for k, v in state.items()}


def _entries(state: dict[str, torch.Tensor]) -> list:
    return [(name, tuple(t.shape), t.dtype, lambda t=t: t) for name, t in state.items()]


def _split(raw: bytes) -> tuple[dict, bytes, int]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:], n


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equality with the same shape and dtype (NaN payloads and -0.0 included)."""
    return (got.shape == want.shape and got.dtype == want.dtype
            and torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)))


def _first_mismatch(a: bytes, b: bytes) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"lengths {len(a)} vs {len(b)}, first difference at byte {i}: {a[i:i + 16]!r} vs {b[i:i + 16]!r}"


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 24])  # one chunk per tensor; many chunks, rows over a chunk
def test_streamed_file_is_save_files_bytes(tmp_path: Path, chunk_bytes: int) -> None:
    state = _state()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    sha = hashlib.sha256()
    data_bytes = write_safetensors(tmp_path / "ours.safetensors", _entries(state), digest=sha, chunk_bytes=chunk_bytes)
    ref, ours = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "ours.safetensors").read_bytes()
    assert ours == ref, _first_mismatch(ours, ref)
    assert sha.hexdigest() == hashlib.sha256(ours).hexdigest()
    assert data_bytes == len(ours) - 8 - _split(ours)[2]


def test_streamed_file_with_checkpoint_metadata_loads_like_save_files(tmp_path: Path) -> None:
    state = _state()
    metadata = {"format": "pt", "moontrain": store.FORMAT}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "ref.safetensors"), metadata=metadata)
    write_safetensors(tmp_path / "ours.safetensors", _entries(state), metadata=metadata, chunk_bytes=40)
    ref_head, ref_data, ref_n = _split((tmp_path / "ref.safetensors").read_bytes())
    head, data, n = _split((tmp_path / "ours.safetensors").read_bytes())
    assert (head, n) == (ref_head, ref_n)
    assert data == ref_data, _first_mismatch(data, ref_data)
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as fh:
        assert fh.metadata() == metadata
        for name, t in state.items():
            assert _same(fh.get_tensor(name), t), name
    reader = SafetensorsReader(tmp_path / "ours.safetensors")
    for name, t in state.items():
        assert _same(reader.tensor(name), t), name
    reader.close()


def test_host_chunks_views_contiguous_cpu_tensors_and_stages_the_rest() -> None:
    t = torch.arange(40, dtype=torch.float32)
    chunks = list(host_chunks([t], chunk_bytes=64))
    assert [len(c) for c in chunks] == [64, 64, 32]
    assert chunks[0].obj.__array_interface__["data"][0] == t.data_ptr()  # a view of the tensor, not a copy
    view = torch.arange(40, dtype=torch.int64).view(8, 5).t()  # [5, 8], rows of 64 bytes
    got = b"".join(bytes(c) for c in host_chunks([view], chunk_bytes=100))
    assert got == view.contiguous().numpy().tobytes()


@pytest.mark.parametrize("size", [0, 5, 64, 1000])
def test_file_sha256_is_hashlibs(tmp_path: Path, size: int) -> None:
    data = bytes(range(256)) * 4
    (tmp_path / "f").write_bytes(data[:size])
    assert file_sha256(tmp_path / "f", block_bytes=64) == hashlib.sha256(data[:size]).hexdigest()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(next(line.split()[1] for line in fh if line.startswith(field + ":")))


def test_streaming_needs_only_the_staging_buffers(tmp_path: Path) -> None:
    """Peak extra RSS of writing 256 MB of non-contiguous tensors through 4 MB staging buffers, and of reading
    them back into preallocated tensors: well under one tensor (32 MB), let alone the state."""
    base = torch.randn(16, 1 << 20)  # 64 MB
    state = {f"t{i}": (base + i).t() for i in range(4)}  # 4 x 64 MB transposed views: all of it staged
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable: the peak RSS cannot be reset")
    rss = _rss_kib("VmRSS")
    write_safetensors(tmp_path / "f.safetensors", _entries(state), chunk_bytes=4 << 20)
    assert (_rss_kib("VmHWM") - rss) * 1024 < 24 << 20
    outs = {name: torch.empty(t.shape) for name, t in state.items()}
    for out in outs.values():
        out.fill_(0)  # resident before the peak is reset
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    rss = _rss_kib("VmRSS")
    reader = SafetensorsReader(tmp_path / "f.safetensors")
    for name, out in outs.items():
        reader.read_into(name, 0, out.shape[0], out)
    reader.close()
    assert (_rss_kib("VmHWM") - rss) * 1024 < 24 << 20
    for name, t in state.items():
        assert torch.equal(outs[name], t), name


def test_read_into_rows_any_destination(tmp_path: Path) -> None:
    state = _state()
    write_safetensors(tmp_path / "f.safetensors", _entries(state))
    reader = SafetensorsReader(tmp_path / "f.safetensors")
    want = state["view.transposed"].contiguous()[3:8]
    out = torch.full((5, 24), -1.0)
    reader.read_into("view.transposed", 3, 8, out)  # contiguous: read straight into it
    assert torch.equal(out, want)
    out_t = torch.full((24, 5), -1.0).t()  # non-contiguous destination
    reader.read_into("view.transposed", 3, 8, out_t)
    assert torch.equal(out_t, want)
    out_f64 = torch.zeros(5, 24, dtype=torch.float64)  # another dtype: converted like copy_
    reader.read_into("view.transposed", 3, 8, out_f64)
    assert torch.equal(out_f64, want.double())
    with pytest.raises(AssertionError, match=re.escape("have shape (5, 24), out has (4, 24)")):
        reader.read_into("view.transposed", 3, 8, torch.empty(4, 24))
    reader.close()


def test_save_reports_size_time_and_throughput(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(small_config("local", 1, run_dir=str(tmp_path)), single_process_layout(torch.device("cpu")))
    train(trainer, 1)
    monkeypatch.setattr(store, "REPORT_AFTER_S", -1.0)
    ckpt = trainer.save_checkpoint()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"moontrain: checkpoint step_00000001 saved, ([0-9.]+) GB in ([0-9.]+) s \(([0-9.]+) GB/s\)",
                         line)
    assert match, line
    total = sum(f.stat().st_size for f in ckpt.iterdir() if f.name != store.MANIFEST)
    assert match.group(1) == f"{total / 1e9:.1f}"
    manifest = json.loads((ckpt / store.MANIFEST).read_text())
    for file, entry in manifest["files"].items():  # the digests hashed while writing are the file's
        data = (ckpt / file).read_bytes()
        if file == store.TRAIN_STATE:
            assert entry["sha256"] == hashlib.sha256(data).hexdigest(), file
        else:
            block = entry["block_bytes"]
            assert entry["block_sha256"] == [hashlib.sha256(data[lo:lo + block]).hexdigest()
                                             for lo in range(0, len(data), block)], file


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_state_through_pinned_staging(tmp_path: Path) -> None:
    state = _state("cuda")
    state["big.fp32"] = torch.randn(3000, 1000, device="cuda")  # 12 MB: many 1 MB chunks, double-buffered
    state["big.view"] = state["big.fp32"][:, ::3]
    save_file({k: v.cpu().contiguous() for k, v in state.items()}, str(tmp_path / "ref.safetensors"),
              metadata={"format": "pt"})
    sha = hashlib.sha256()
    write_safetensors(tmp_path / "ours.safetensors", _entries(state), digest=sha, chunk_bytes=1 << 20)
    ref, ours = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "ours.safetensors").read_bytes()
    assert ours == ref, _first_mismatch(ours, ref)
    assert sha.hexdigest() == hashlib.sha256(ours).hexdigest()
    reader = SafetensorsReader(tmp_path / "ours.safetensors")
    for name, t in state.items():
        out = torch.empty(t.shape, dtype=t.dtype, device="cuda")
        reader.read_into(name, 0, t.shape[0] if t.ndim else 0, out, chunk_bytes=1 << 20)
        assert _same(out, t), name
    reader.close()


@pytest.mark.gpu
def test_cuda_trainer_save_and_load_bitwise(tmp_path: Path) -> None:
    cfg = small_config("local", 1, run_dir=str(tmp_path))
    trainer = Trainer(cfg, single_process_layout(torch.device("cuda")))
    train(trainer, 2)
    ckpt = trainer.save_checkpoint()
    want = {k: v.cpu() for k, v in full_state(trainer).items()}
    trainer.close()
    fresh = Trainer(cfg, single_process_layout(torch.device("cuda")))
    fresh.load_checkpoint(ckpt)
    assert fresh.step == 2
    assert_bitwise({k: v.cpu() for k, v in full_state(fresh).items()}, want, "CUDA save -> load")
    fresh.close()
