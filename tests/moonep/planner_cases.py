"""Histograms for planner-kernel tests: K distinct experts per token drawn from a log-normal popularity."""

from __future__ import annotations

import torch


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
