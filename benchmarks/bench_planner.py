"""GPU time of the fused planner's kernels (moonep.planner.fused) per variant, pass by pass.

    python benchmarks/bench_planner.py [--experts 384] [--topk 8] [--ranks 2] [--tokens 8192]   (one GPU)
    python benchmarks/bench_planner.py --experts 896 --topk 16 --ranks 8 --tokens 8192           (K3)

Every rank of an R-rank problem is simulated on one GPU (as moonep.testing.simulate_fused does: the
chunk passes of all ranks fill one [R, R, E] histogram region, program order stands in for the
barrier). A variant is (chunk, warps of the chunk kernel, warps of the shared kernel). For each:
the plans of every rank are checked bitwise against moonep.planner.make_plan on the CPU, then rank
0's launches are captured in CUDA graphs and replayed: each kernel alone (count, prefix, shared,
dest), the chunk pass (count + prefix), the shared + destination pass, and all four (`total`, the
number a plan costs). Median of --iters replays, timed by CUDA events around each replay (GPU time;
the host only launches one graph). `b2b`: the `total` graph replayed 20 times back to back between
two events, divided by 20 (median of --iters / 5 such runs): a plan's cost when it is queued behind
other work, as in training, without the idle start of a single replay. `floor` is the same timing of
a graph holding one tiny kernel (and its b2b timing): every column includes it once, so a kernel's
own time is roughly its column minus the floor.
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
from moonep.planner import Plan, make_plan
from moonep.planner import fused as pf
from moonep.routing import RoutingResult, generate_routing
from moonep.testing import PLAN_FIELDS, assert_same_plan

# (chunk, chunk-kernel warps, shared-kernel warps); the first is the library's default
VARIANTS = ((pf.CHUNK, 4, pf._SHARED_WARPS), (512, 8, 2), (256, 4, 2), (256, 2, 2), (512, 4, 4))
COLUMNS = ("count", "prefix", "shared", "dest", "chunk_pass", "shared_dest", "total", "total_b2b")
BACK_TO_BACK = 20  # replays per timing of the b2b column


def add_problem_args(p: argparse.ArgumentParser, experts: int, topk: int, ranks: int) -> None:
    """The simulated problem's shape options (shared with benchmarks/diagnostics/profile_planner.py)."""
    p.add_argument("--experts", type=int, default=experts)
    p.add_argument("--topk", type=int, default=topk)
    p.add_argument("--ranks", type=int, default=ranks)
    p.add_argument("--tokens", type=int, default=8192)


def simulated_problem(args: argparse.Namespace, maxvio: float = 1.0
                      ) -> tuple[Layout, RoutingResult, list[torch.Tensor], list[Plan]]:
    """(layout, routing, each rank's top-k ids on the GPU, each rank's make_plan plan) of the R-rank
    problem the shape options name (seed 0; every rank is simulated on this GPU)."""
    R, E, K, S = args.ranks, args.experts, args.topk, args.tokens
    if E % R:
        raise ValueError(f"--experts {E} must be a multiple of --ranks {R}")
    layout = Layout(BufferConfig(max_tokens=S, hidden=8, topk=K, num_experts=E), R, 4096)
    t0 = time.time()
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio, seed=0)
    print(f"routing: R={R} E={E} K={K} s={S} maxvio {routing.realised_maxvio:.2f} [{time.time() - t0:.0f} s]",
          flush=True)
    topk_R = [routing.topk_RsK[r].cuda() for r in range(R)]
    counts = routing.tokens_per_expert_RE.to(torch.int32)
    want_R = [make_plan(layout, r, routing.topk_RsK[r], counts) for r in range(R)]
    return layout, routing, topk_R, want_R


def graph_us(fn, iters: int, back_to_back: int = 1) -> float:
    """Median GPU microseconds per replay of fn captured in a CUDA graph, timed over `back_to_back`
    replays queued between two events (1: a single replay, the stream idle before it)."""
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / back_to_back)
    return statistics.median(times[3:])


def check_variant(layout: Layout, topk_R: list[torch.Tensor], want_R: list[Plan], work: list, name: str
                  ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Plans of every rank with these workspaces, bitwise against make_plan's (want_R); returns
    (hist_all, outs)."""
    R, E = layout.num_ranks, layout.config.num_experts
    dev = topk_R[0].device
    s = topk_R[0].shape[0]
    hist_all = torch.zeros(R, R, E, dtype=torch.int32, device=dev)
    plan_layout = [pf._PlanLayout(layout, r, s, None) for r in range(R)]
    flats = [pl.empty(dev).fill_(0x5A5A5A5A) for pl in plan_layout]  # garbage: the kernels write every field
    outs = [pl.views(f) for pl, f in zip(plan_layout, flats, strict=True)]
    cap_base, cap_rem = pf.receive_cap_args(R, layout.config.topk, s, None)
    for r in range(R):
        pf.chunk_pass(topk_R[r], r, hist_all, work[r])
    for r in range(R):
        pf.plan_pass(topk_R[r], r, hist_all[r], work[r], outs[r], layout, cap_base, cap_rem)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for r in range(R):  # correctness of this variant before its time means anything
        got = plan_layout[r].plan(flats[r])
        got = type(got)(**{**vars(got), **{n: getattr(got, n).cpu() for n in PLAN_FIELDS}})
        assert_same_plan(got, want_R[r], f"{name} rank {r}")
    return hist_all, outs


def bench_variant(layout: Layout, topk_R: list[torch.Tensor], want_R: list[Plan], chunk: int, warps: int,
                  shared_warps: int, iters: int) -> dict:
    R = layout.num_ranks
    E = layout.config.num_experts
    s = topk_R[0].shape[0]
    work = [pf._Workspace(layout, s, topk_R[0].device, chunk, warps, shared_warps) for _ in range(R)]
    hist_all, outs = check_variant(layout, topk_R, want_R, work, f"chunk={chunk} warps={warps} shared_warps={shared_warps}")
    cap_base, cap_rem = pf.receive_cap_args(R, layout.config.topk, s, None)
    topk, w, out = topk_R[0], work[0], outs[0]
    steps = {
        "count": lambda: pf.count_step(topk, E, w),
        "prefix": lambda: pf.prefix_step(0, hist_all, w),
        "shared": lambda: pf.shared_step(0, hist_all[0], w, out, layout, cap_base, cap_rem),
        "dest": lambda: pf.dest_step(topk, w, out, layout),
    }
    steps["chunk_pass"] = lambda: pf.chunk_pass(topk, 0, hist_all, w)
    steps["shared_dest"] = lambda: pf.plan_pass(topk, 0, hist_all[0], w, out, layout, cap_base, cap_rem)

    def total() -> None:
        steps["chunk_pass"]()
        steps["shared_dest"]()

    steps["total"] = total
    row = {"chunk": chunk, "warps": warps, "shared_warps": shared_warps}
    row.update({f"{name}_us": graph_us(fn, iters) for name, fn in steps.items()})
    row["total_b2b_us"] = graph_us(total, max(5, iters // 5), BACK_TO_BACK)
    return row


def format_table(rows: list[dict]) -> str:
    head = ("chunk", "warps", "sh.warps", *COLUMNS[:-1], "b2b")
    lines = [" ".join(f"{h:>11}" for h in head)]
    for r in rows:
        cells = [str(r["chunk"]), str(r["warps"]), str(r["shared_warps"])]
        cells += [f"{r[c + '_us']:.1f}" for c in COLUMNS]
        lines.append(" ".join(f"{c:>11}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(p, experts=384, topk=8, ranks=2)
    p.add_argument("--maxvio", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--variants", type=int, default=len(VARIANTS), help="measure the first N variants only")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    R, E, K, S = args.ranks, args.experts, args.topk, args.tokens
    layout, routing, topk_R, want_R = simulated_problem(args, args.maxvio)  # the same for every variant
    floor_buf = torch.zeros(1, device="cuda")
    floor = graph_us(lambda: floor_buf.add_(1), args.iters)
    floor_b2b = graph_us(lambda: floor_buf.add_(1), args.iters, BACK_TO_BACK)
    rows, failed = [], []
    for chunk, warps, shared_warps in VARIANTS[: args.variants]:
        t0 = time.time()
        name = f"chunk {chunk} warps {warps} shared warps {shared_warps}"
        try:  # one failing variant (a compile or bitwise mismatch) must not hide the others' numbers
            rows.append(bench_variant(layout, topk_R, want_R, chunk, warps, shared_warps, args.iters))
        except Exception as exc:  # reported, recorded and turned into the exit status
            failed.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"{name}: FAILED {failed[-1]['error']}", flush=True)
            continue
        print(f"{name}: bitwise equal to make_plan on {R} ranks, {rows[-1]['total_us']:.1f} us "
              f"[{time.time() - t0:.0f} s]", flush=True)
    print(f"\nfused planner kernels, R={R} simulated, E={E}, s={S}, K={K}, maxvio {routing.realised_maxvio:.2f}, "
          f"{torch.cuda.get_device_name()}: GPU us per CUDA-graph replay (median of {args.iters}; b2b: per replay of "
          f"{BACK_TO_BACK} back to back); floor (one tiny kernel) {floor:.1f} us, {floor_b2b:.1f} us back to back")
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_planner_R{R}_E{E}_K{K}_{time.strftime('%Y%m%d')}.json"
    meta = {"R": R, "E": E, "S": S, "K": K, "maxvio": routing.realised_maxvio, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "iters": args.iters, "floor_us": floor, "floor_b2b_us": floor_b2b,
            "back_to_back": BACK_TO_BACK}
    path.write_text(json.dumps({"config": meta, "variants": rows, "failed": failed}, indent=1))
    print(f"wrote {path}")
    if failed:
        sys.exit(f"{len(failed)} variant(s) failed: {[f['variant'] for f in failed]}")


if __name__ == "__main__":
    main()
