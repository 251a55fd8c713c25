"""Routings for planner-kernel tests (K distinct experts per token drawn from a log-normal
popularity), checked through the fused planner simulated for every rank in one process
(moonep.testing)."""

from __future__ import annotations

import dataclasses

import torch

from moonep.config import BufferConfig
from moonep.layout import Layout
from moonep.planner import make_plan
from moonep.testing import PLAN_FIELDS, assert_same_plan, simulate_fused


def random_counts(R: int, E: int, K: int, s: int, sigma: float, g: torch.Generator) -> torch.Tensor:
    """int32 [R, E]: every rank's tokens_per_expert for s tokens of K distinct experts (Gumbel top-k)."""
    p = torch.exp(torch.randn(E, generator=g) * sigma)
    counts = torch.zeros(R, E, dtype=torch.int32)
    for r in range(R):
        gumbel = -torch.log(-torch.log(torch.rand(s, E, generator=g)))
        topk = torch.topk(torch.log(p) + gumbel, K, dim=1).indices
        counts[r] = torch.bincount(topk.view(-1), minlength=E).int()
    return counts


def planner_cases(n: int, ranks: tuple[int, ...], max_epn: int, big: tuple[tuple[int, int], ...],
                  seed: int = 0) -> list[tuple[int, int, int, int, int, int, float]]:
    """(R, E, K, s, B, token_padding, sigma): n random small problems (B = epn, or fewer slots every
    third case), then the benchmark shapes in `big` at sigma 0, 1, 3."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(n):
        R = ranks[i % len(ranks)]
        epn = int(torch.randint(1, max_epn + 1, (1,), generator=g))
        E = R * epn
        K = int(torch.randint(1, E + 1, (1,), generator=g))
        s = int(torch.randint(1, 64, (1,), generator=g))
        B = epn if i % 3 else max(1, epn // 2)
        cases.append((R, E, K, s, B, (1, 2, 4, 16)[i % 4], float(torch.rand(1, generator=g)) * 3))
    cases += [(R, E, 8, 512, E // R, 16, sigma) for R, E in big for sigma in (0.0, 1.0, 3.0)]
    return cases


def random_topk(s: int, E: int, K: int, sigma: float, g: torch.Generator) -> torch.Tensor:
    """int32 [s, K]: K distinct experts per token from a log-normal popularity (Gumbel top-k)."""
    p = torch.exp(torch.randn(E, generator=g) * sigma)
    gumbel = -torch.log(-torch.log(torch.rand(s, E, generator=g)))
    return torch.topk(torch.log(p) + gumbel, K, dim=1).indices.to(torch.int32)


FusedCase = tuple[int, int, int, list[int], int, int, float, bool]  # R, E, K, s per rank, B, pad, sigma, per_rank


def check_fused_cases(cases: list[FusedCase], g: torch.Generator, device: str = "cpu", chunk: int | None = None
                      ) -> None:
    """simulate_fused on `device` for every rank of every case, bitwise against make_plan on the CPU
    (per_rank: ranks have different s and pass total_num_tokens)."""
    for i, (R, E, K, s_R, B, pad, sigma, per_rank) in enumerate(cases):
        if device != "cpu":  # on a GPU each new shape compiles: say which case runs (pytest -s)
            print(f"fused case {i + 1}/{len(cases)}: R={R} E={E} K={K} s={s_R[:2]} B={B} pad={pad}", flush=True)
        topk_R = [random_topk(s, E, K, sigma, g) for s in s_R]
        check_fused_topk(topk_R, E, B, pad, per_rank, f"sigma={sigma:.2f}", device, chunk)


def check_fused_topk(topk_R: list[torch.Tensor], E: int, B: int | None, pad: int, per_rank: bool, context: str = "",
                     device: str = "cpu", chunk: int | None = None, max_tokens: int | None = None) -> None:
    """simulate_fused for the given routing of every rank, bitwise against make_plan on the CPU
    (max_tokens: the layout's, max(s) if None)."""
    R, s_R, K = len(topk_R), [t.shape[0] for t in topk_R], topk_R[0].shape[1]
    layout = Layout(BufferConfig(max_tokens=max_tokens or max(s_R), hidden=8, topk=K, num_experts=E, token_padding=pad,
                                 num_slots=B), R, 4096)
    total = sum(s_R) if per_rank else None
    counts = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E) for t in topk_R]).to(torch.int32)
    for r, got in enumerate(simulate_fused(layout, [t.to(device) for t in topk_R], total, chunk)):
        want = make_plan(layout, r, topk_R[r], counts, total_num_tokens=total)
        got = dataclasses.replace(got, **{n: getattr(got, n).cpu() for n in PLAN_FIELDS})
        assert_same_plan(got, want, f"rank {r} of R={R} E={E} K={K} s={s_R} B={B} pad={pad} {context} total={total} "
                                    f"chunk={chunk}")


def group_skewed_topk(s: int, E: int, K: int, num_groups: int, epn: int, g: torch.Generator) -> torch.Tensor:
    """int32 [s, K]: K distinct experts per token, uniform over the experts of the first num_groups
    home groups only: those groups donate to every other rank, each receiver takes many experts of
    similar size, so slots run out (remote experts keep their home rows) when B is small."""
    gumbel = -torch.log(-torch.log(torch.rand(s, num_groups * epn, generator=g)))
    return torch.topk(gumbel, K, dim=1).indices.to(torch.int32)
