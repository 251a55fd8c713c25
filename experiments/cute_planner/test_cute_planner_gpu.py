"""The CuTe DSL planner kernel (experiments.cute_planner.cute_planner) equals the PyTorch planner's shared part
(moonep.planner.reference.plan_shared, run on the CPU) bitwise, launches without a host sync, replays inside a
CUDA graph; its time at R=2, E=384 is printed (run with -s).

Each static shape (R, E, B, token_padding) compiles once (about a second); the random routings of a
shape reuse it."""

from __future__ import annotations

import statistics

import pytest
import torch

from moonep.planner.reference import plan_shared, receive_caps
from tests.moonep.helpers.planner_cases import planner_cases, random_counts

pytest.importorskip("cutlass")
pytestmark = pytest.mark.gpu

NAMES = ("quota_RR", "alloc_ER", "slot_expert_RB", "group_ER", "group_rows_RG", "offs_RG")
# (R, E, K, s, B, token_padding, sigma): R in 1, 2, 4, 8 with B = epn or fewer, padding 1..16, then the
# benchmark shapes at sigma 0, 1, 3 (planner_cases), then fewer slots than remote experts at E = 384,
# and shapes whose alloc does not fit in shared memory (R = 16, E = 768) or with R > 32 (two balances
# per lane in the receiver filling)
CASES = [
    *planner_cases(36, (1, 2, 4, 8), 8, ((2, 96), (2, 384), (4, 384), (8, 384)), seed=5),
    (1, 384, 8, 512, 100, 16, 2.0), (2, 384, 8, 512, 100, 1, 0.0), (2, 384, 8, 512, 100, 1, 3.0),
    (8, 384, 8, 512, 20, 16, 3.0), (16, 768, 8, 256, 48, 16, 1.0), (64, 1024, 8, 64, 16, 16, 3.0),
    (64, 128, 4, 32, 1, 1, 1.0),
]


def _assert_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], context: str) -> None:
    for name, a, b in zip(NAMES, got, want, strict=True):
        a = a.cpu()
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (f"{context}: {name} is {a.dtype}{list(a.shape)}, "
                                                          f"plan_shared gives {b.dtype}{list(b.shape)}")
        if not torch.equal(a, b):
            bad = tuple((a != b).nonzero()[0].tolist())
            raise AssertionError(f"{context}: {name} differs first at {list(bad)}: cute kernel {a[bad].item()} vs "
                                 f"plan_shared {b[bad].item()} ({int((a != b).sum())} of {a.numel()} differ)")


def _routings(R: int, E: int, K: int, s: int, sigma: float, g: torch.Generator
              ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, counts_RE, cap_R) on the CPU: the case's routing, a heavily skewed one, and per-rank
    token counts (uneven caps from total_num_tokens)."""
    out = []
    for sig in (sigma, 4.0):
        counts = random_counts(R, E, K, s, sig, g)
        out.append((f"sigma={sig:.2f}", counts, receive_caps(R, K, num_tokens=s, total_num_tokens=None, device="cpu")))
    s_R = [int(torch.randint(1, 2 * s + 1, (1,), generator=g)) for _ in range(R)]
    counts = torch.cat([random_counts(1, E, K, s_r, sigma, g) for s_r in s_R])
    cap = receive_caps(R, K, num_tokens=None, total_num_tokens=sum(s_R), device="cpu")
    out.append((f"per-rank s={s_R}", counts, cap))
    return out


def test_cute_planner_bitwise_equals_plan_shared() -> None:
    from experiments.cute_planner.cute_planner import plan_shared as plan_shared_cute

    g = torch.Generator().manual_seed(11)
    shapes = set()
    for R, E, K, s, B, pad, sigma in CASES:
        shapes.add((R, E, B, pad))
        for label, counts, cap in _routings(R, E, K, s, sigma, g):
            want = plan_shared(counts, cap, B, pad)
            got = plan_shared_cute(counts.cuda(), cap.cuda(), B, pad)
            _assert_equal(got, want, f"R={R} E={E} K={K} s={s} B={B} pad={pad} {label}")
    print(f"\ncute planner: {len(CASES) * 3} routings on {len(shapes)} shapes bitwise equal to plan_shared")


def test_cute_planner_without_host_sync() -> None:
    from experiments.cute_planner.cute_planner import plan_shared as plan_shared_cute

    g = torch.Generator().manual_seed(12)
    R, E, K, s, B, pad = 2, 384, 8, 2048, 192, 16
    cap = receive_caps(R, K, num_tokens=s, total_num_tokens=None, device="cpu")
    counts = [random_counts(R, E, K, s, sigma, g) for sigma in (0.0, 1.0, 3.0, 5.0)]
    plan_shared_cute(counts[0].cuda(), cap.cuda(), B, pad)  # compiles and loads the module (may sync)
    counts_dev = [c.cuda() for c in counts]
    cap_dev = cap.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [plan_shared_cute(c, cap_dev, B, pad) for c in counts_dev]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for c, plan in zip(counts, got, strict=True):
        _assert_equal(plan, plan_shared(c, cap, B, pad), f"no-sync call R={R} E={E}")


def test_cute_planner_in_cuda_graph() -> None:
    """Captured once, replayed on new histograms copied into the captured input."""
    from experiments.cute_planner.cute_planner import plan_shared as plan_shared_cute

    g = torch.Generator().manual_seed(13)
    R, E, K, s, B, pad = 2, 384, 8, 2048, 192, 16
    cap = receive_caps(R, K, num_tokens=s, total_num_tokens=None, device="cpu").cuda()
    counts_in = random_counts(R, E, K, s, 1.0, g).cuda()
    plan_shared_cute(counts_in, cap, B, pad)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan_shared_cute(counts_in, cap, B, pad)
    for sigma in (0.0, 2.0, 4.0):
        counts = random_counts(R, E, K, s, sigma, g)
        counts_in.copy_(counts)
        graph.replay()
        torch.cuda.synchronize()
        _assert_equal(out, plan_shared(counts, cap.cpu(), B, pad), f"graph replay sigma={sigma}")


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
