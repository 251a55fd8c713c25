"""The fused planner (moonep.planner.fused) in Triton's interpreter on the CPU, bitwise against make_plan:
simulated for R = 1..8 in one process, its chunk kernel against a one-hot reference, the workspace's
knobs, int64 keys, and run by a 2-rank Buffer (plans are integers: bitwise equal or wrong).
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and installs the interpreter's shims
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moonep import BufferConfig, BufferOptions
from moonep.layout import Layout
from moonep.planner import make_plan
from moonep.testing import assert_same_plan
from tests.dist_utils import run_ranks
from tests.moonep.helpers.planner_cases import (
    check_fused_cases,
    check_fused_topk,
    group_skewed_topk,
    planner_cases,
    random_topk,
)


def _matches_make_plan_cases(part: str) -> tuple[list, torch.Generator]:
    """test_fused_planner_matches_make_plan's cases in three parts of similar time (the R = 8 cases dominate),
    each with its own generator: random small problems with equal s per rank, the same with per-rank s (and
    total_num_tokens), then shapes with several chunks of 512 entries, K not a power of two, the benchmark's E."""
    g = torch.Generator().manual_seed({"equal_s": 2, "per_rank_s": 3, "shapes": 4}[part])
    if part == "equal_s":
        return [(R, E, K, [s] * R, B, pad, sigma, False)
                for R, E, K, s, B, pad, sigma in planner_cases(16, (1, 2, 4, 8), 6, ())], g
    if part == "per_rank_s":
        return [(R, E, K, [int(torch.randint(1, 2 * s + 1, (1,), generator=g)) for _ in range(R)], B, pad, sigma, True)
                for R, E, K, s, B, pad, sigma in planner_cases(8, (2, 4, 8), 6, (), seed=1)], g
    return [(2, 384, 8, [512, 512], 192, 16, 3.0, False), (2, 384, 8, [700, 333], 96, 16, 1.0, True),
            (4, 64, 6, [400] * 4, 16, 4, 0.0, False), (2, 8, 1, [2100, 2100], 2, 2, 2.0, False),
            (8, 384, 8, [130] * 8, 48, 16, 3.0, False), (8, 112, 16, [64] * 8, 14, 16, 3.0, False)], g


@pytest.mark.slow  # the slowest CPU tests (~20-40 s each in the interpreter); CI runs them
@pytest.mark.parametrize("part", ["equal_s", "per_rank_s", "shapes"])
def test_fused_planner_matches_make_plan(part: str) -> None:
    cases, g = _matches_make_plan_cases(part)
    check_fused_cases(cases, g)


@pytest.mark.slow
def test_fused_planner_slots_run_out() -> None:
    """Routings on the lowest home groups only: every receiver takes many experts of similar size, so
    with few slots remote experts keep their home rows (docs/moonep.md §5.4), and a donor may become a receiver;
    the last two at K3's ratios (E / R = 14, K = 16, R = 8)."""
    g = torch.Generator().manual_seed(5)
    for R, E, K, s, groups, B, pad in ((2, 16, 4, 40, 1, 2, 4), (8, 112, 16, 48, 3, 3, 16), (8, 112, 16, 64, 3, 14, 1)):
        epn = E // R
        topk_R = [group_skewed_topk(s, E, K, groups, epn, g) for _ in range(R)]
        check_fused_topk(topk_R, E, B, pad, False, f"{groups} donor groups")
        counts = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E) for t in topk_R]).to(torch.int32)
        plan = make_plan(Layout(BufferConfig(max_tokens=s, hidden=8, topk=K, num_experts=E, token_padding=pad,
                                             num_slots=B), R, 4096), 0, topk_R[0], counts)
        home_rows_R = plan.group_rows_RG[:, :E].view(R, R, epn).sum(2)  # [rank, home group]
        remote_home_rows = int(home_rows_R.sum() - home_rows_R.diagonal().sum())
        assert (remote_home_rows > 0) == (B < epn), f"B={B}: {remote_home_rows} remote rows on home rows"


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [32, 1024])  # 256: test_fused_gpu.py on the GPU tier
def test_fused_planner_other_chunk_sizes(chunk: int) -> None:
    """The chunk size is a tuning knob (benchmarks/bench_planner.py): many chunks per expert run, runs
    crossing chunk ends, a last partial chunk, K not a power of two, K3's K = 16 and E / R = 14 at
    R = 8."""
    g = torch.Generator().manual_seed(4)
    cases = [(2, 384, 8, [512, 512], 192, 16, 3.0, False), (2, 384, 8, [700, 333], 96, 16, 1.0, True),
             (4, 16, 3, [37] * 4, 4, 2, 2.0, False), (8, 64, 8, [64] * 8, 8, 4, 0.5, False),
             (8, 112, 16, [40] * 8, 14, 16, 3.0, False)]
    check_fused_cases(cases, g, chunk=chunk)


def test_fused_planner_one_rank_without_slots() -> None:
    """One rank's default layout has B = 0 (no remote expert, docs/moonep.md §4.2): the shared kernel's slot
    tile is one masked lane, the plan has no slot column and its groups are the E experts."""
    g = torch.Generator().manual_seed(6)
    for E, K, s, pad, sigma in ((8, 2, 37, 4, 2.0), (96, 8, 64, 16, 0.5)):
        check_fused_topk([random_topk(s, E, K, sigma, g)], E, None, pad, False, "B=None at R=1")


def test_fused_chunk_kernel_matches_reference() -> None:
    """The chunk pass's kernel alone against a one-hot reference: per-chunk histograms and each
    entry's rank among the chunk's entries of its expert; E a power of two (the padding id E needs
    one more bit), E = 1 (one run through every chunk), K not a power of two, a last partial chunk."""
    from moonep.planner import fused as pf

    g = torch.Generator().manual_seed(7)
    for E, K, s, chunk in ((512, 16, 70, 64), (1, 1, 100, 32), (96, 6, 45, 64), (896, 16, 40, 512)):
        topk = random_topk(s, E, K, 2.0, g)
        layout = Layout(BufferConfig(max_tokens=s, hidden=8, topk=K, num_experts=E), 1, 4096)
        work = pf._Workspace(layout, s, torch.device("cpu"), chunk)
        work.chunk_hist.fill_(-7), work.rank_in_chunk.fill_(-7)  # garbage: the kernel writes every element
        pf.count_step(topk, E, work)
        flat = torch.nn.functional.pad(topk.reshape(-1).long(), (0, work.num_chunks * chunk - s * K), value=E)
        onehot = torch.nn.functional.one_hot(flat.view(-1, chunk), E + 1)  # [chunks, chunk, E + 1]
        want_rank = ((onehot.cumsum(1) - onehot) * onehot).sum(2).view(-1)[: s * K]
        context = f"E={E} K={K} s={s} chunk={chunk}"
        assert torch.equal(work.chunk_hist, onehot.sum(1)[:, :E].int()), f"{context}: chunk histograms"
        bad = (work.rank_in_chunk != want_rank).nonzero()
        assert bad.numel() == 0, f"{context}: rank of entry {bad[0].item()} is {work.rank_in_chunk[bad[0]].item()}"


def test_fused_workspace_rejects_bad_knobs() -> None:
    from moonep.planner import fused as pf

    layout = Layout(BufferConfig(max_tokens=8, hidden=8, topk=2, num_experts=4), 1, 4096)
    for chunk in (16, 96):
        with pytest.raises(ValueError, match=f"chunk={chunk}: .* pass a power of two >= 32"):
            pf._Workspace(layout, 8, torch.device("cpu"), chunk)


def test_fused_planner_int64_keys() -> None:
    """A layout whose max_tokens puts R * max_tokens * K past the int32 argmax keys of the shared
    kernel: the int64 keys plan the same as make_plan."""
    from moonep.planner import fused as pf

    g = torch.Generator().manual_seed(8)
    R, E, K, s = 4, 32, 4, 50
    big = Layout(BufferConfig(max_tokens=2**24, hidden=8, topk=K, num_experts=E), R, 4096)
    small = Layout(BufferConfig(max_tokens=s, hidden=8, topk=K, num_experts=E), R, 4096)
    assert pf._key64(big) and not pf._key64(small)
    for sigma in (0.0, 3.0):
        topk_R = [random_topk(s, E, K, sigma, g) for _ in range(R)]
        check_fused_topk(topk_R, E, E // R, 4, False, f"int64 keys, sigma={sigma}", max_tokens=2**24)


def _fused_plan_rank(rank: int, world: int) -> list[int]:
    import moonep.buffer as buffer_module
    from moonep import Buffer
    from moonep.routing import generate_routing

    S, K, E = 300, 6, 12 * world
    cfg = BufferConfig(max_tokens=S, hidden=16, topk=K, num_experts=E, token_padding=4, num_slots=5,
                       options=BufferOptions(num_sms=3))
    # the triton path is CUDA-only by design; force it onto the CPU heap for the interpreter
    buffer_module.resolve_kernels = lambda kernels, device: "triton"
    buf = Buffer(cfg)
    try:
        assert buf.kernel_path == "triton"
        used = []
        for maxvio, s_R, pass_hist in ((0.3, (S, S), True), (3.0, (S, S), False), (2.0, (S, 171), True)):
            routing = generate_routing(num_ranks=world, tokens_per_rank=S, num_experts=E, topk=K,
                                       target_maxvio=maxvio, seed=11)
            topk_R = [routing.topk_RsK[r][: s_R[r]].contiguous() for r in range(world)]
            counts = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E) for t in topk_R]).to(torch.int32)
            total = sum(s_R) if s_R[0] != s_R[1] else None
            hist = counts[rank] if pass_hist else None
            for _ in range(2):  # a second call reuses the workspace (the ticket is back at 0)
                plan = buf.plan(topk_R[rank], hist, total_num_tokens=total)
                buf.barrier("test:planned")  # plan() twice in a row needs a barrier between (hist region)
                want = make_plan(buf.layout, rank, topk_R[rank], counts, total_num_tokens=total)
                assert_same_plan(plan, want, f"rank {rank} maxvio {maxvio} s={s_R}")
            used.append(int((plan.slot_expert_RB >= 0).sum()))
        return used
    finally:
        buf.destroy()


def test_fused_planner_in_buffer_matches_make_plan() -> None:
    used = run_ranks(_fused_plan_rank, 2, timeout_s=300)
    assert any(n > 0 for n in used[0]), f"some routing should occupy slots: {used}"
