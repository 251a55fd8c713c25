"""GPU time of the dispatch scatter kernel per store mode (moonep.kernels.dispatch_combine.SCATTER_MODE).

    python benchmarks/bench_scatter.py [--hidden 2048 7168] [--maxvio 0 0.2 10]     (one GPU)

Rank 0 of an R = 2 problem scatters into a receive region of both ranks that lives on this one GPU,
so the numbers hold the kernel's own cost (issue, latency, local HBM) without NVLink: what differs
between the modes. Every mode's receive rows, metadata and weights are compared bitwise with mode 0.
Median of --iters replays of the launch captured in a CUDA graph, timed by CUDA events (as
bench_planner.py; bench_scatter_20261130.json timed eager launches). Table printed; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_planner import graph_us
from moonep import BufferConfig
from moonep.kernels import dispatch_combine as dc
from moonep.layout import Layout
from moonep.planner import make_plan
from moonep.routing import generate_routing

MODES = (0, 1, 2)


def run_mode(mode: int, plan, x: torch.Tensor, w: torch.Tensor, regions: dict, grid: int, iters: int) -> float:
    work = dc.scatter_work(x.device)

    def launch() -> None:
        dc.scatter(x, w, plan.dst_rank_sK, plan.dst_row_sK, plan.copy_row_sK, plan.sent_sK, regions["recv"],
                   regions["row_weight"], regions["row_link"], 0, grid, work, mode=mode)

    return graph_us(launch, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    p.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 0.2, 10.0])
    p.add_argument("--experts", type=int, default=96)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    R, E, K, S = 2, args.experts, args.topk, args.tokens
    dev = torch.device("cuda")
    grid = dc.num_sms(dev, None)
    rows = []
    for H in args.hidden:
        cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E)
        layout = Layout(cfg, R, 4096)
        nvs = layout.comm["recv"].shape[0] - 2
        x = torch.randn(S, H, device=dev).to(torch.bfloat16)
        w = torch.rand(S, K, device=dev)
        for maxvio in args.maxvio:
            routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio,
                                       seed=0)
            plan = make_plan(layout, 0, routing.topk_RsK[0], routing.tokens_per_expert_RE.to(torch.int32))
            plan = type(plan)(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(plan).items()})
            results, first = {}, None
            for mode in MODES:
                regions = {"recv": torch.zeros(R, nvs + 2, H, dtype=torch.bfloat16, device=dev),
                           "row_weight": torch.zeros(R, nvs + 1, device=dev),
                           "row_link": torch.zeros(R, nvs + 1, 2, dtype=torch.int32, device=dev)}
                t0 = time.time()
                results[mode] = run_mode(mode, plan, x, w, regions, grid, args.iters)
                if first is None:
                    first = regions
                else:
                    for name, t in regions.items():
                        if not torch.equal(t, first[name]):
                            raise AssertionError(f"mode {mode} differs from mode 0 in {name} (H={H}, maxvio {maxvio})")
                print(f"H={H} maxvio {routing.realised_maxvio:.2f} mode {mode}: {results[mode]:.1f} us "
                      f"[{time.time() - t0:.0f} s]", flush=True)
            rows.append({"hidden": H, "maxvio": routing.realised_maxvio, "sent_rows": int(plan.sent_sK.sum()),
                         **{f"mode{m}_us": v for m, v in results.items()}})
    print(f"\nscatter kernel, rank 0 of R=2 on one GPU (no NVLink), S={S}, K={K}, E={E}, {grid} programs, "
          f"{torch.cuda.get_device_name()}: us per launch (median of {args.iters} graph replays); modes equal bitwise")
    print(f"{'H':>5} {'maxvio':>6} {'rows':>6} " + " ".join(f"{'mode ' + str(m):>8}" for m in MODES))
    for r in rows:
        print(f"{r['hidden']:>5} {r['maxvio']:>6.2f} {r['sent_rows']:>6} "
              + " ".join(f"{r[f'mode{m}_us']:>8.1f}" for m in MODES))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_scatter_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
