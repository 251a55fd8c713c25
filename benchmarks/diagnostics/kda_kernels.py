"""KDA's forward + backward by kernel on one GPU: fla's chunk_kda (moontrain.model.kda.ops.kda_fla, its dqkg
stage on --dqkg's kernel, the intra-chunk stage on fla's), with and without packed documents, under
torch.profiler (CUDA activity alone).

    python benchmarks/diagnostics/kda_kernels.py [--case 4x4096x16] [--doc-len 1024] [--iters 10]
        [--recompute off on] [--dqkg moontrain|fla] [--intra fla_k64|fla] [--gate-norm fla moontrain intra_norm]

Prints, per case, each kernel's time a call (the mean over --iters profiled calls after 5 untimed ones), its
launches a call and the kernels' total; that total leaves out the launch gaps bench_kda.py's wall times hold.
Beside it: the call's median wall time (CUDA events around forward + backward, --iters calls) and the bytes the
forward leaves saved for the backward (allocated after the forward minus before). --recompute: fla's
disable_recompute negated (kernels.kda_recompute), one table per value; --dqkg: the WY / inter-chunk backward
stage on moontrain's kernel or fla's (kernels.kda_dqkg); --intra: fla's intra-chunk stage's launch
(kernels.kda_intra); --gate-norm: the call's two elementwise ends on fla's kernels or moontrain's
(kernels.kda_gate_norm), or intra_norm: moontrain's, with the intra-chunk stage and the norms' backward in one
kernel (kernels.kda_intra=moontrain); one table per value. The defaults are the model's: off, moontrain, fla_k64,
fla.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.kda.ops import kda_fla, random_kda_inputs


def kernel_table(B: int, T: int, H: int, doc_len: int | None, iters: int, recompute: bool, gate_norm: str
                 ) -> tuple[float, list[tuple], float, int]:
    """(kernel us a call in all, [(us a call, launches a call, name)] largest first, median wall ms a call,
    bytes saved by the forward for the backward)."""
    leaves, kwargs, go = random_kda_inputs(B, T, H, 128, doc_len=doc_len)
    kwargs["recompute"] = recompute
    kwargs["gate_norm"] = gate_norm != "fla"
    kwargs["intra_norm"] = gate_norm == "intra_norm"

    def run() -> None:
        o = kda_fla(*leaves, **kwargs)
        torch.autograd.grad(o, leaves, go)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = kda_fla(*leaves, **kwargs)
    saved = torch.cuda.memory_allocated() - before - o.numel() * o.element_size()
    del o
    wall_ms = median_ms(run, iters, 0)
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
    return sum(us for us, _, _ in table), table, wall_ms, saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="4x4096x16", help="BxTxH (KDA heads of 128)")
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--recompute", nargs="+", choices=("on", "off"), default=["off"])
    p.add_argument("--dqkg", choices=("fla", "moontrain"), default="moontrain")
    p.add_argument("--intra", choices=("fla_k64", "fla"), default="fla_k64")
    p.add_argument("--gate-norm", nargs="+", choices=("fla", "moontrain", "intra_norm"), default=["fla"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kda_kernels needs a CUDA GPU and fla-core")
    from moontrain.model.kda.fla_backend import route_fla_stages

    route_fla_stages(dqkg=args.dqkg, intra=args.intra)
    B, T, H = (int(x) for x in args.case.split("x"))
    summary = []
    for gate_norm in args.gate_norm:
        for recompute in args.recompute:
            for doc_len in (None, args.doc_len):
                total, table, wall_ms, saved = kernel_table(B, T, H, doc_len, args.iters, recompute == "on",
                                                            gate_norm)
                summary.append((gate_norm, recompute, doc_len, total, wall_ms, saved))
                print(f"\n== {args.case}, documents {doc_len}, recompute {recompute}, dqkg {args.dqkg}, gate_norm "
                      f"{gate_norm}: kernels {total:.1f} us a call, wall {wall_ms * 1e3:.1f} us, saved for backward "
                      f"{saved / 2**20:.0f} MiB")
                for us, n, name in table:
                    print(f"{us:9.1f} us  x{n:2d}  {name[:110]}")
    print(f"\n{'gate_norm':>10s} {'recompute':>9s} {'documents':>9s} {'kernels us':>10s} {'wall us':>8s} "
          f"{'saved MiB':>9s}")
    for gate_norm, recompute, doc_len, total, wall_ms, saved in summary:
        print(f"{gate_norm:>10s} {recompute:>9s} {doc_len!s:>9s} {total:10.1f} {wall_ms * 1e3:8.1f} "
              f"{saved / 2**20:9.0f}")


if __name__ == "__main__":
    main()
