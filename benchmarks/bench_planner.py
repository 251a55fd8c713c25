"""GPU time of the fused planner's kernels (moonep.planner.fused) per chunk size and warps.

    python benchmarks/bench_planner.py [--experts 384] [--tokens 8192] [--ranks 2]     (one GPU)

Every rank of an R-rank problem is simulated on one GPU (as tests/moonep/planner_cases.py does: the
chunk passes of all ranks fill one [R, R, E] histogram region, program order stands in for the
barrier). For each (chunk, warps) variant: the plans of every rank are checked bitwise against
moonep.planner.make_plan on the CPU, then rank 0's kernels are captured in CUDA graphs and
replayed: the chunk pass alone, the shared + destination pass alone, and both. Median of --iters
replays, timed by CUDA events around each replay (GPU time; the host only launches one graph).
Table printed; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from moonep import BufferConfig
from moonep.layout import Layout
from moonep.planner import fused as pf
from moonep.planner import make_plan
from moonep.routing import generate_routing
from tests.moonep.planner_cases import PLAN_FIELDS, assert_same_plan

# (chunk, warps) of the chunk pass
VARIANTS = ((1024, 4), (512, 4), (256, 4), (2048, 4), (2048, 8))


def graph_us(fn, iters: int) -> float:
    """Median GPU microseconds of one replay of fn captured in a CUDA graph."""
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def bench_variant(layout: Layout, topk_R: list[torch.Tensor], counts_RE: torch.Tensor, chunk: int, warps: int,
                  iters: int) -> dict:
    R, E = layout.num_ranks, layout.config.num_experts
    dev = topk_R[0].device
    s = topk_R[0].shape[0]
    hist_all = torch.zeros(R, R, E, dtype=torch.int32, device=dev)
    work = [pf._Workspace(layout, s, dev, chunk, warps) for _ in range(R)]
    plan_layout = [pf._PlanLayout(layout, r, s, None) for r in range(R)]
    flats = [pl.empty(dev) for pl in plan_layout]
    outs = [pl.views(f) for pl, f in zip(plan_layout, flats, strict=True)]
    cap_base, cap_rem = pf.receive_cap_args(R, layout.config.topk, s, None)
    for r in range(R):
        pf.chunk_pass(topk_R[r], r, hist_all, work[r])
    for r in range(R):
        pf.plan_pass(topk_R[r], r, hist_all[r], work[r], outs[r], layout, cap_base, cap_rem)
    torch.cuda.synchronize()
    for r in range(R):  # correctness of this variant before its time means anything
        got = plan_layout[r].plan(flats[r])
        got = type(got)(**{**vars(got), **{n: getattr(got, n).cpu() for n in PLAN_FIELDS}})
        assert_same_plan(got, make_plan(layout, r, topk_R[r].cpu(), counts_RE),
                         f"chunk={chunk} warps={warps} rank {r}")

    def chunk_only() -> None:
        pf.chunk_pass(topk_R[0], 0, hist_all, work[0])

    def plan_only() -> None:
        pf.plan_pass(topk_R[0], 0, hist_all[0], work[0], outs[0], layout, cap_base, cap_rem)

    def both() -> None:
        chunk_only()
        plan_only()

    return {"chunk": chunk, "warps": warps, "chunk_pass_us": graph_us(chunk_only, iters),
            "shared_dest_us": graph_us(plan_only, iters), "total_us": graph_us(both, iters)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--maxvio", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    R, E, K, S = args.ranks, args.experts, args.topk, args.tokens
    layout = Layout(BufferConfig(max_tokens=S, hidden=8, topk=K, num_experts=E), R, 4096)
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=args.maxvio,
                               seed=0)
    topk_R = [routing.topk_RsK[r].cuda() for r in range(R)]
    counts = routing.tokens_per_expert_RE.to(torch.int32)
    rows = []
    for chunk, warps in VARIANTS:
        t0 = time.time()
        rows.append(bench_variant(layout, topk_R, counts, chunk, warps, args.iters))
        print(f"chunk {chunk} warps {warps}: bitwise equal to make_plan on {R} ranks, "
              f"{rows[-1]['total_us']:.1f} us [{time.time() - t0:.0f} s]", flush=True)
    print(f"\nfused planner kernels, R={R} simulated, E={E}, s={S}, K={K}, maxvio {routing.realised_maxvio:.2f}, "
          f"{torch.cuda.get_device_name()}: GPU us per CUDA-graph replay (median of {args.iters})")
    print(f"{'chunk':>6} {'warps':>5} {'chunk pass':>10} {'shared+dest':>11} {'total':>7}")
    for r in rows:
        print(f"{r['chunk']:>6} {r['warps']:>5} {r['chunk_pass_us']:>10.1f} {r['shared_dest_us']:>11.1f} "
              f"{r['total_us']:>7.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_planner_R{R}_E{E}_{time.strftime('%Y%m%d')}.json"
    meta = {"R": R, "E": E, "S": S, "K": K, "maxvio": routing.realised_maxvio, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "iters": args.iters}
    path.write_text(json.dumps({"config": meta, "variants": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
