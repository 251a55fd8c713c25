"""The kernel warm-up's compile work, measured without a GPU: every entry of one or more warm-up manifests
(moontrain.trainer.kernel_warmup) compiled by Triton for the manifest's GPU architecture on this host's CPU, one
after the other into an empty cache, and timed; then per manifest its kernels' seconds by kernel name, the sum,
and the time W processes would take (the manifest's order, and longest first).

    python benchmarks/diagnostics/warmup_cost.py recipes/data/triton_kernels_sm90.json [OLD.json ...] --out F.json

The figures are the compile work alone (Triton's passes and ptxas); a job's warm-up also pays each process's
start (imports, a CUDA context), which only a GPU run shows (its `kernel warm-up: ...` line). The installed
Triton compiles: a manifest recorded with another Triton version compiles here under this one's options (the
options this Triton does not know are dropped), so compare manifests within one run.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere


def compile_seconds(entry, arch: str) -> float:
    """One entry compiled for `arch` (e.g. sm90) with no driver: Triton's own source of a JITFunction, the
    recorded constexprs, attributes and options (as JITFunction.preload reads them)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from moontrain.trainer import kernel_warmup as kw

    data = json.loads(entry.specialization)
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else v
                  for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)}
    target = GPUTarget("cuda", int(arch.removeprefix("sm")), 32)
    known = set(CUDABackend(target).parse_options({}).__dict__)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()
               if k in known and k not in kw.FORBIDDEN_OPTIONS}
    src = ASTSource(kw._resolve(entry.module, entry.name), dict(data["signature"]), constexprs, attrs)
    t0 = time.perf_counter()
    triton.compile(src, target=target, options=options)
    return time.perf_counter() - t0


def makespan(seconds: list[float], workers: int) -> float:
    """The wall time of `workers` processes each taking the next task as it frees (the warm-up's pool)."""
    free = [0.0] * workers
    for s in seconds:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("manifests", nargs="+")
    p.add_argument("--workers", type=int, default=8, help="the warm-up's processes (train.kernel_warmup_workers)")
    p.add_argument("--out", default=None, help="write the per-entry seconds and the table as JSON")
    args = p.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="warmup_cost_")  # every entry really compiles
    from moontrain.trainer import kernel_warmup as kw

    seconds: dict[tuple[str, str, str], float] = {}
    rows = []
    for path in args.manifests:
        m = kw.load_manifest(path)
        for i, e in enumerate(m.kernels):
            key = (e.module, e.name, e.specialization)
            if key not in seconds:
                seconds[key] = compile_seconds(e, m.arch)
                print(f"  [{i + 1}/{len(m.kernels)}] {seconds[key]:6.2f} s {e.label}", flush=True)
        times = [seconds[(e.module, e.name, e.specialization)] for e in m.kernels]
        by_name = collections.Counter()
        for e, s in zip(m.kernels, times, strict=True):
            by_name[e.name] += s
        rows.append(dict(manifest=path, kernels=len(times), serial_s=sum(times),
                         in_order_s=makespan(times, args.workers),
                         longest_first_s=makespan(sorted(times, reverse=True), args.workers),
                         by_kernel={k: round(v, 2) for k, v in by_name.most_common()}))
    print(f"\n| manifest | kernels | compile s, serial | {args.workers} processes, its order | longest first |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['manifest']} | {r['kernels']} | {r['serial_s']:.1f} | {r['in_order_s']:.1f} | "
              f"{r['longest_first_s']:.1f} |")
    if args.out:
        import triton

        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "workers": args.workers, "rows": rows,
                                              "entries": [[f"{k[0]}.{k[1]}", _short(k[2]), round(v, 3)]
                                                          for k, v in seconds.items()]}, indent=1))


def _short(specialization: str) -> str:
    """An entry's specialisation named by a short hash (the manifests hold the text)."""
    import hashlib

    return hashlib.sha256(specialization.encode()).hexdigest()[:12]


if __name__ == "__main__":
    main()
