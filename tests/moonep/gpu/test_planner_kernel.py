"""The Triton planner kernel (shared part, SPEC 5.2-5.4) equals the PyTorch planner bitwise on GPU."""

from __future__ import annotations

import pytest
import torch

from moonep.planner import plan_shared, receive_caps

pytestmark = pytest.mark.gpu

NAMES = ("quota_RR", "alloc_ER", "slot_expert_RB", "group_ER", "group_rows_RG", "offs_RG")


def _counts(R: int, E: int, K: int, s: int, sigma: float, g: torch.Generator) -> torch.Tensor:
    p = torch.exp(torch.randn(E, generator=g) * sigma)
    counts = torch.zeros(R, E, dtype=torch.int32)
    for r in range(R):
        gumbel = -torch.log(-torch.log(torch.rand(s, E, generator=g)))
        topk = torch.topk(torch.log(p) + gumbel, K, dim=1).indices
        counts[r] = torch.bincount(topk.view(-1), minlength=E).int()
    return counts


def _cases(n: int) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for i in range(n):
        R = (1, 2, 4, 8, 16)[i % 5]
        epn = int(torch.randint(1, 9, (1,), generator=g))
        E = R * epn
        K = int(torch.randint(1, E + 1, (1,), generator=g))
        s = int(torch.randint(1, 64, (1,), generator=g))
        B = epn if i % 3 else max(1, epn // 2)
        cases.append((R, E, K, s, B, (1, 4, 16)[i % 3], float(torch.rand(1, generator=g)) * 3))
    for R, E in ((2, 96), (2, 384), (8, 384), (16, 384)):
        for sigma in (0.0, 1.0, 3.0):
            cases.append((R, E, 8, 1024, E // R, 16, sigma))
    return cases


def test_planner_kernel_bitwise_equals_pytorch_planner() -> None:
    from moonep.kernels.planner import plan_shared as plan_shared_kernel

    g = torch.Generator().manual_seed(1)
    for R, E, K, s, B, pad, sigma in _cases(200):
        counts = _counts(R, E, K, s, sigma, g).cuda()
        cap = receive_caps(R, K, num_tokens=s, total_num_tokens=None, device=counts.device)
        want = plan_shared(counts, cap, B, pad)
        got = plan_shared_kernel(counts, cap, B, pad)
        for name, a, b in zip(NAMES, got, want, strict=True):
            if not torch.equal(a.long(), b.long()):
                bad = (a.long() != b.long()).nonzero()[0].tolist()
                raise AssertionError(f"{name} differs at {bad} for R={R} E={E} K={K} s={s} B={B} pad={pad} "
                                     f"sigma={sigma:.2f}: kernel {a[tuple(bad)].item()} vs {b[tuple(bad)].item()}")
