"""KDA's forward + backward by kernel on one GPU: fla's chunk_kda (moontrain.model.kda.ops.kda_fla, with the
fla stages routed as the process has them: fla's own unless kernels.kda_dqkg / kda_intra routed them here),
with and without packed documents, under torch.profiler (CUDA activity alone).

    python benchmarks/diagnostics/kda_kernels.py [--case 4x4096x16] [--doc-len 1024] [--iters 10]

Prints, per case, each kernel's time a call (the mean over --iters profiled calls after 5 untimed ones), its
launches a call and the kernels' total; that total leaves out the launch gaps bench_kda.py's wall times hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from moontrain.model.kda.ops import kda_fla, random_kda_inputs


def kernel_table(B: int, T: int, H: int, doc_len: int | None, iters: int) -> tuple[float, list[tuple]]:
    """(kernel us a call in all, [(us a call, launches a call, name)] largest first)."""
    leaves, kwargs, go = random_kda_inputs(B, T, H, 128, doc_len=doc_len)

    def run() -> None:
        o = kda_fla(*leaves, **kwargs)
        torch.autograd.grad(o, leaves, go)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = rows.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.device_time
    table = sorted(((us / iters, n // iters, name) for name, (n, us) in rows.items()), reverse=True)
    return sum(us for us, _, _ in table), table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="4x4096x16", help="BxTxH (KDA heads of 128)")
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kda_kernels needs a CUDA GPU and fla-core")
    B, T, H = (int(x) for x in args.case.split("x"))
    for doc_len in (None, args.doc_len):
        total, table = kernel_table(B, T, H, doc_len, args.iters)
        print(f"\n== {args.case}, documents {doc_len}: kernels {total:.1f} us a call")
        for us, n, name in table:
            print(f"{us:9.1f} us  x{n:2d}  {name[:110]}")


if __name__ == "__main__":
    main()
