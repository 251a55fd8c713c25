"""The Triton planner kernel (shared part, SPEC 5.2-5.4) equals the PyTorch planner bitwise on GPU."""

from __future__ import annotations

import pytest
import torch

from moonep.planner import plan_shared, receive_caps
from tests.moonep.planner_cases import planner_cases, random_counts

pytestmark = pytest.mark.gpu

NAMES = ("quota_RR", "alloc_ER", "slot_expert_RB", "group_ER", "group_rows_RG", "offs_RG")


def test_planner_kernel_bitwise_equals_pytorch_planner() -> None:
    from moonep.kernels.planner import plan_shared as plan_shared_kernel

    g = torch.Generator().manual_seed(1)
    for R, E, K, s, B, pad, sigma in planner_cases(200, (1, 2, 4, 8, 16), 8, ((2, 96), (2, 384), (8, 384), (16, 384))):
        counts = random_counts(R, E, K, s, sigma, g).cuda()
        cap = receive_caps(R, K, num_tokens=s, total_num_tokens=None, device=counts.device)
        want = plan_shared(counts, cap, B, pad)
        got = plan_shared_kernel(counts, cap, B, pad)
        for name, a, b in zip(NAMES, got, want, strict=True):
            if not torch.equal(a.long(), b.long()):
                bad = (a.long() != b.long()).nonzero()[0].tolist()
                raise AssertionError(f"{name} differs at {bad} for R={R} E={E} K={K} s={s} B={B} pad={pad} "
                                     f"sigma={sigma:.2f}: kernel {a[tuple(bad)].item()} vs {b[tuple(bad)].item()}")
