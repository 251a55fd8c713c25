"""The fused planner (moonep.planner.fused) equals the PyTorch planner bitwise on the GPU, simulated
for several ranks on one GPU and in Buffer.plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions
from moonep.planner import Plan, make_plan
from moonep.routing import generate_routing
from moonep.testing import PLAN_FIELDS, assert_same_plan
from tests.moonep.helpers.planner_cases import (
    check_fused_cases,
    check_fused_topk,
    group_skewed_topk,
    planner_cases,
)

pytestmark = pytest.mark.gpu


def test_fused_planner_bitwise_equals_make_plan() -> None:
    """moonep.planner.fused for every rank of R = 1..8 simulated on one GPU, vs make_plan on the CPU.

    Few distinct shapes: each compiles the three kernels anew (~10-20 s per shape from a cold Triton
    cache, minutes at R = 16; the full random sweep with R up to 16 runs in Triton's interpreter in
    CI). On 2xH200 (2026-11-29) the first 6 cases of the earlier list (R = 1, 4, 16 small shapes,
    R = 2 at E = 96) passed within the time limit; R = 16 at E = 384 compiles for minutes."""
    g = torch.Generator().manual_seed(3)
    cases = [(R, E, K, [s] * R, B, pad, sigma, False)
             for R, E, K, s, B, pad, sigma in planner_cases(3, (1, 4, 8), 8, ((2, 96), (8, 384)))]
    cases += [(R, E, K, [int(torch.randint(1, 2 * s + 1, (1,), generator=g)) for _ in range(R)], B, pad, sigma, True)
              for R, E, K, s, B, pad, sigma in planner_cases(1, (4,), 8, (), seed=1)]
    cases += [(2, 384, 8, [8192, 8192], 192, 16, sigma, False) for sigma in (0.0, 1.0, 3.0)]
    cases += [(2, 384, 8, [8192, 5000], 192, 16, 2.0, True), (8, 384, 8, [4096] * 8, 48, 16, 3.0, False)]
    check_fused_cases(cases, g, device="cuda")


def test_fused_planner_k3_shapes() -> None:
    """K3's planner shapes (E = 896, K = 16, s = 8192) at R = 8 and 2 simulated on one GPU, and a
    routing on three home groups with 8 slots (slots run out, a donor may turn receiver), vs
    make_plan on the CPU; three shapes to compile (~1 min)."""
    g = torch.Generator().manual_seed(6)
    check_fused_cases([(8, 896, 16, [8192] * 8, 112, 16, 1.0, False), (2, 896, 16, [8192] * 2, 448, 16, 3.0, False)],
                      g, device="cuda")
    topk_R = [group_skewed_topk(2048, 896, 16, 3, 112, g) for _ in range(8)]
    check_fused_topk(topk_R, 896, 8, 16, False, "3 donor groups", device="cuda")


def test_fused_planner_chunk_256_k3() -> None:
    """The chunk kernel at chunk 256 (benchmarks/bench_planner.py's other chunk size), K3's shape
    on the GPU (its popcount is the popc instruction here, SWAR arithmetic in the interpreter),
    equal and unequal s per rank, vs make_plan on the CPU."""
    g = torch.Generator().manual_seed(9)
    cases = [(8, 896, 16, [8192] * 8, 112, 16, 1.0, False), (2, 896, 16, [5000, 8192], 448, 16, 3.0, True)]
    check_fused_cases(cases, g, device="cuda", chunk=256)


@pytest.mark.multigpu
def test_buffer_plan_fused_no_sync_and_in_graph(group: dist.ProcessGroup) -> None:
    """Buffer.plan on the triton path (graph replays, then inside a caller's CUDA graph capture) is
    bitwise make_plan of the gathered histograms and never synchronises with the host."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    S, K, E = 2048, 8, 384
    buf = Buffer(BufferConfig(max_tokens=S, hidden=128, topk=K, num_experts=E,
                              options=BufferOptions(check_values=False, timeout_s=30.0)), group)
    try:
        assert buf.kernel_path == "triton"
        routings = [generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=v, seed=i)
                    for i, v in enumerate((0.2, 20.0, 0.0, 3.0, 1.0))]

        def want(i: int) -> Plan:
            return make_plan(buf.layout, rank, routings[i].topk_RsK[rank], routings[i].tokens_per_expert_RE)

        topk = [r.topk_RsK[rank].cuda() for r in routings]
        hist = [r.tokens_per_expert_RE[rank].cuda() for r in routings]
        got = [buf.plan(topk[0], hist[0])]  # first call of the shape: compiles and captures (host syncs)
        buf.barrier("test:plan")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in (1, 2, 3):
                got.append(buf.plan(topk[i], hist[i] if i % 2 else None))
                buf.barrier("test:plan")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # inside a caller's capture: the kernels launch directly into graph-pool outputs
        topk_in = topk[2].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            captured = buf.plan(topk_in, None)
        topk_in.copy_(topk[4])
        graph.replay()
        torch.cuda.synchronize()
        for i, plan in enumerate(got):  # compared after every call: plans must not alias later outputs
            cpu = dataclasses.replace(plan, **{n: getattr(plan, n).cpu() for n in PLAN_FIELDS})
            assert_same_plan(cpu, want(i), f"rank {rank}, call {i}")
        cpu = dataclasses.replace(captured, **{n: getattr(captured, n).cpu() for n in PLAN_FIELDS})
        assert_same_plan(cpu, want(4), f"rank {rank}, replayed capture")
        # released plans are reused from the pool: it stops growing, and reused plans are right
        (pool,) = buf.path._planner._graphs.values()
        del got, plan, captured
        for i in range(6):
            cpu = buf.plan(topk[i % 5], None)
            buf.barrier("test:plan")
            cpu = dataclasses.replace(cpu, **{n: getattr(cpu, n).cpu() for n in PLAN_FIELDS})
            assert_same_plan(cpu, want(i % 5), f"rank {rank}, pooled call {i}")
        assert len(pool.entries) <= 4, f"{len(pool.entries)} pooled plans for 1 plan held at a time"
    finally:
        buf.destroy()
