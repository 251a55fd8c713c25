"""Per-kernel GPU time of one fused plan (moonep.planner.fused, the library's default variant), from
torch.profiler over CUDA-graph replays, with every rank of an R-rank problem simulated on one GPU as
benchmarks/bench_planner.py does.

    python benchmarks/diagnostics/profile_planner.py [--experts 896] [--topk 16] [--ranks 8] [--tokens 8192]

Prints, for rank 0's plan (checked bitwise against make_plan on every rank first):
    the graph's replay timed by CUDA events three ways: one replay on an idle GPU, one replay queued
    behind a spin kernel (the host's launch hidden), 20 replays back to back (per replay);
    each kernel's median device time over --iters replays (each behind a spin kernel), the median
    span from the first kernel's start to the last one's end, and the gaps between the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.bench_planner import add_problem_args, check_variant, simulated_problem
from moonep.planner import fused as pf

SPIN_CYCLES = 1_000_000  # torch.cuda._sleep before a timed replay: ~0.5 ms, longer than the host's launch


def event_us(fn, iters: int, repeat: int = 1, spin: bool = False) -> float:
    """Median microseconds per call of fn between two CUDA events (repeat calls per timing)."""
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(p, experts=896, topk=16, ranks=8)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    R, E, K, S = args.ranks, args.experts, args.topk, args.tokens
    layout, _, topk_R, want = simulated_problem(args)
    work = [pf._Workspace(layout, S, topk_R[0].device) for _ in range(R)]
    hist_all, outs = check_variant(layout, topk_R, want, work, "default")
    cap_base, cap_rem = pf.receive_cap_args(R, K, S, None)

    def plan() -> None:
        pf.chunk_pass(topk_R[0], 0, hist_all, work[0])
        pf.plan_pass(topk_R[0], 0, hist_all[0], work[0], outs[0], layout, cap_base, cap_rem)

    plan()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    print(f"fused plan, R={R} simulated, E={E}, K={K}, s={S}, {torch.cuda.get_device_name()}, rank 0 "
          f"(bitwise equal to make_plan on every rank)")
    print(f"  one replay, idle GPU          {event_us(graph.replay, args.iters):7.1f} us")
    print(f"  one replay behind a spin      {event_us(graph.replay, args.iters, spin=True):7.1f} us")
    print(f"  20 replays back to back       {event_us(graph.replay, args.iters, repeat=20):7.1f} us per replay")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            torch.cuda._sleep(SPIN_CYCLES // 5)
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "spin" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    per_name = defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.device_time)
    n = len(per_name)  # kernels per replay
    for name, times in per_name.items():
        print(f"  {name[:40]:40s} x{len(times):3d}  median {statistics.median(times):6.2f} us")
    replays = [kernels[i:i + n] for i in range(0, len(kernels) - n + 1, n)]
    span = statistics.median(r[-1].time_range.end - r[0].time_range.start for r in replays)
    gaps = [statistics.median(r[j + 1].time_range.start - r[j].time_range.end for r in replays) for j in range(n - 1)]
    print(f"  span first start -> last end  {span:7.1f} us; gaps between kernels (median) "
          + ", ".join(f"{g:.2f}" for g in gaps) + " us")


if __name__ == "__main__":
    main()
