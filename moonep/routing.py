"""Routing with a target maxvio: the generator behind moonep's tests and benchmarks (docs/moonep.md §9).

    maxvio = max_e (T_e / T_mean) - 1      T_e = tokens routed to expert e, T_mean = sum_e T_e / E

Protocol (matches MoonEP's benchmark convention, so numbers compare):
- Expert popularity p_e = exp(N(0, sigma)), drawn from a stream seeded by `seed` and shared by all
  ranks. Each rank r draws its s tokens' K *distinct* experts from p with its own stream seeded by
  (seed, r), by the Gumbel-top-k trick: topk_k(log p_e + G_te) with G Gumbel noise, which is
  sampling K experts without replacement with probabilities proportional to p.
- sigma is bisected on a log scale (log sigma in [-8, 3]) until the realised *global* maxvio is
  within tolerance of the target; the realised value is always reported.
- sigma = 0 (target 0) is round-robin: token t of rank r takes experts ((r*s + t)*K + k) mod E,
  k = 0..K-1, which are distinct for K <= E and give maxvio 0 when R*s*K is a multiple of E.
- Every rank computes every rank's routing locally from the seeds, so no collective is needed and
  all ranks agree bitwise. Random numbers are drawn on the CPU and moved to `device`, so the
  routing does not depend on the device either.

Sampling noise floor. Independent sampling cannot reach an arbitrarily small maxvio: even at
uniform p the per-expert counts are binomial, and max_e T_e / T_mean - 1 is about 3 standard
deviations, ~0.27 at R=2, s=512, E=96, K=8 (but ~0.07 at the benchmark size R=8, s=8192, E=384).
When the target lies below that floor, the generator keeps p uniform (sigma = 0) and samples only
the first n tokens of each rank, the rest taking their round-robin experts; n is bisected the same
way and reported as `sampled_fraction` = n / s. At benchmark sizes this branch is not taken.
Rejected: a softer Gumbel temperature (it changes the distribution being sampled, so the result
is no longer "K distinct experts drawn from p").

Shape legend: R ranks, s tokens per rank, E routed experts, K top-k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "RoutingResult",
    "expert_maxvio",
    "generate_routing",
    "group_loads",
    "max_maxvio",
    "rank_load",
    "rank_maxvio",
]

_LOG_SIGMA_RANGE = (-8.0, 3.0)
# Stream ids below 2**20 are reserved per seed: stream 0 draws popularity, stream r + 1 rank r.
_STREAM_BITS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingResult:
    """Routing of every rank, as every rank computes it.

    topk_RsK: int32 [R, s, K] expert ids, K distinct per token.
    tokens_per_expert_RE: int32 [R, E] per-rank histograms (row r is rank r's tokens_per_expert_E).
    sigma: log-normal popularity spread used (0 for round-robin or uniform sampling).
    sampled_fraction: share of each rank's tokens that were sampled (the rest are round-robin);
        1 unless the target lies below the sampling noise floor, 0 for pure round-robin.
    realised_maxvio: expert_maxvio of the global histogram.
    """

    topk_RsK: torch.Tensor = field(repr=False)
    tokens_per_expert_RE: torch.Tensor = field(repr=False)
    sigma: float
    sampled_fraction: float
    realised_maxvio: float

    def for_rank(self, rank_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_sK, tokens_per_expert_E) of one rank: the inputs of its dispatch call."""
        return self.topk_RsK[rank_idx], self.tokens_per_expert_RE[rank_idx]


def _histogram_1d(name: str, counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    counts_N = torch.as_tensor(counts)
    if counts_N.dim() != 1 or counts_N.numel() == 0:
        raise ValueError(f"{name} needs a non-empty 1-D histogram, got shape {tuple(counts_N.shape)}")
    total = counts_N.sum().item()
    if total <= 0:
        raise ValueError(f"{name}: the histogram sums to {total}; no tokens were routed, so it has no mean")
    return counts_N


def expert_maxvio(tokens_per_expert_E: torch.Tensor | Sequence[int]) -> float:
    """max_e(T_e / T_mean) - 1 with T_mean = sum(T) / E; 0 means perfectly balanced."""
    counts_E = _histogram_1d("expert_maxvio", tokens_per_expert_E)
    return counts_E.max().item() * counts_E.numel() / counts_E.sum().item() - 1.0


def rank_load(tokens_per_rank_R: torch.Tensor | Sequence[int]) -> tuple[float, float]:
    """(max, mean) of the tokens each rank processes; the max sets the step time."""
    counts_R = _histogram_1d("rank_load", tokens_per_rank_R)
    return float(counts_R.max().item()), counts_R.sum().item() / counts_R.numel()


def rank_maxvio(tokens_per_rank_R: torch.Tensor | Sequence[int]) -> float:
    """max/mean - 1 of per-rank loads: the imbalance EP pays (0 after moonep's planner)."""
    max_load, mean_load = rank_load(tokens_per_rank_R)
    return max_load / mean_load - 1.0


def group_loads(tokens_per_expert_E: torch.Tensor | Sequence[int], num_ranks: int) -> torch.Tensor:
    """Tokens per home rank [R] without redundant experts: rank r hosts experts [r*epn, (r+1)*epn)."""
    counts_E = torch.as_tensor(tokens_per_expert_E)
    if counts_E.dim() != 1:
        raise ValueError(f"group_loads needs a 1-D histogram, got shape {tuple(counts_E.shape)}")
    _check_positive("num_ranks", num_ranks)
    num_experts = counts_E.numel()
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"group_loads: E={num_experts} experts are not a multiple of num_ranks={num_ranks}; "
            "choose E divisible by R so that every rank hosts epn = E // R experts"
        )
    return counts_E.view(num_ranks, num_experts // num_ranks).sum(dim=1)


def max_maxvio(num_experts: int, topk: int) -> float:
    """Largest reachable maxvio, E/K - 1: one expert in every token's top-k (e.g. all on the same K)."""
    _check_positive("num_experts", num_experts)
    _check_positive("topk", topk)
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}; a token needs K distinct experts")
    return num_experts / topk - 1.0


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _stream_seed(seed: int, stream_idx: int) -> int:
    return (seed << _STREAM_BITS) | stream_idx


class _Sampler:
    """Fixed random numbers of one (seed, R, s, E) problem; only sigma and n vary in the search."""

    def __init__(
        self,
        *,
        num_ranks: int,
        tokens_per_rank: int,
        num_experts: int,
        topk: int,
        seed: int,
        device: str | torch.device,
    ) -> None:
        self.num_ranks, self.num_experts, self.topk = num_ranks, num_experts, topk
        popularity_gen = torch.Generator().manual_seed(_stream_seed(seed, 0))
        self.z_E = torch.randn(num_experts, generator=popularity_gen).to(device)
        # Gumbel noise is -log(Exp(1)); drawn once, since only sigma and n change during the search.
        gumbel_RsE = torch.empty(num_ranks, tokens_per_rank, num_experts)
        for rank_idx in range(num_ranks):
            rank_gen = torch.Generator().manual_seed(_stream_seed(seed, rank_idx + 1))
            gumbel_RsE[rank_idx].exponential_(generator=rank_gen)
        self.gumbel_RsE = gumbel_RsE.log_().neg_().to(device)
        self.round_robin_RsK = _round_robin(num_ranks, tokens_per_rank, num_experts, topk, device)
        self.token_idx_s1 = torch.arange(tokens_per_rank, device=device).unsqueeze(1)

    def route(self, sigma: float, num_sampled: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        # log p_e = sigma * z_e; Gumbel-top-k of log p samples K distinct experts from p.
        scores_RsE = self.gumbel_RsE + sigma * self.z_E
        sampled_RsK = scores_RsE.topk(self.topk, dim=-1).indices.to(torch.int32)
        topk_RsK = torch.where(self.token_idx_s1 < num_sampled, sampled_RsK, self.round_robin_RsK)
        tokens_per_expert_RE = _histograms(topk_RsK, self.num_experts)
        return topk_RsK, tokens_per_expert_RE, expert_maxvio(tokens_per_expert_RE.sum(dim=0))


def _round_robin(
    num_ranks: int, tokens_per_rank: int, num_experts: int, topk: int, device: str | torch.device
) -> torch.Tensor:
    global_token_idx_Rs1 = torch.arange(num_ranks * tokens_per_rank, device=device).view(
        num_ranks, tokens_per_rank, 1
    )
    k_idx_K = torch.arange(topk, device=device)
    return ((global_token_idx_Rs1 * topk + k_idx_K) % num_experts).to(torch.int32)


def _histograms(topk_RsK: torch.Tensor, num_experts: int) -> torch.Tensor:
    num_ranks = topk_RsK.shape[0]
    rank_offset_R11 = torch.arange(num_ranks, device=topk_RsK.device).view(num_ranks, 1, 1) * num_experts
    flat_ids = (topk_RsK.long() + rank_offset_R11).flatten()
    counts = torch.bincount(flat_ids, minlength=num_ranks * num_experts)
    return counts.view(num_ranks, num_experts).to(torch.int32)


def generate_routing(
    *,
    num_ranks: int,
    tokens_per_rank: int,
    num_experts: int,
    topk: int,
    target_maxvio: float,
    seed: int = 0,
    device: str | torch.device = "cpu",
    tolerance: float = 0.02,
    max_steps: int = 40,
) -> RoutingResult:
    """Routing of all R ranks whose global expert maxvio is close to `target_maxvio`.

    The search stops once |realised - target| <= tolerance * max(1, target), or after max_steps
    bisection steps with the closest routing seen; check `realised_maxvio` for what was reached.
    """
    for name, value in (
        ("num_ranks", num_ranks),
        ("tokens_per_rank", tokens_per_rank),
        ("num_experts", num_experts),
        ("topk", topk),
        ("max_steps", max_steps),
    ):
        _check_positive(name, value)
    largest = max_maxvio(num_experts, topk)
    if not 0.0 <= target_maxvio <= largest:
        raise ValueError(
            f"target_maxvio={target_maxvio} is outside [0, E/K - 1]: with E={num_experts} and "
            f"K={topk} the largest reachable maxvio is E/K - 1 = {largest:g}"
        )
    if not 0 <= seed < 2 ** (63 - _STREAM_BITS):
        raise ValueError(f"seed={seed} must be in [0, 2**{63 - _STREAM_BITS})")
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")

    if target_maxvio == 0.0:
        topk_RsK = _round_robin(num_ranks, tokens_per_rank, num_experts, topk, device)
        tokens_per_expert_RE = _histograms(topk_RsK, num_experts)
        return RoutingResult(
            topk_RsK=topk_RsK,
            tokens_per_expert_RE=tokens_per_expert_RE,
            sigma=0.0,
            sampled_fraction=0.0,
            realised_maxvio=expert_maxvio(tokens_per_expert_RE.sum(dim=0)),
        )

    sampler = _Sampler(
        num_ranks=num_ranks,
        tokens_per_rank=tokens_per_rank,
        num_experts=num_experts,
        topk=topk,
        seed=seed,
        device=device,
    )
    abs_tolerance = tolerance * max(1.0, target_maxvio)
    best: RoutingResult | None = None

    def try_point(sigma: float, num_sampled: int) -> float:
        nonlocal best
        topk_RsK, tokens_per_expert_RE, maxvio = sampler.route(sigma, num_sampled)
        if best is None or abs(maxvio - target_maxvio) < abs(best.realised_maxvio - target_maxvio):
            best = RoutingResult(
                topk_RsK=topk_RsK,
                tokens_per_expert_RE=tokens_per_expert_RE,
                sigma=sigma,
                sampled_fraction=num_sampled / tokens_per_rank,
                realised_maxvio=maxvio,
            )
        return maxvio

    log_lo, log_hi = _LOG_SIGMA_RANGE
    floor_maxvio = try_point(math.exp(log_lo), tokens_per_rank)
    if floor_maxvio > target_maxvio + abs_tolerance:
        # Below the noise floor of uniform sampling: bisect the number of sampled tokens instead.
        lo_n, hi_n = 0, tokens_per_rank
        for _ in range(max_steps):
            if hi_n - lo_n <= 1:
                break
            mid_n = (lo_n + hi_n) // 2
            maxvio = try_point(0.0, mid_n)
            if abs(maxvio - target_maxvio) <= abs_tolerance:
                break
            lo_n, hi_n = (mid_n, hi_n) if maxvio < target_maxvio else (lo_n, mid_n)
    elif abs(floor_maxvio - target_maxvio) > abs_tolerance:
        for _ in range(max_steps):
            log_mid = 0.5 * (log_lo + log_hi)
            maxvio = try_point(math.exp(log_mid), tokens_per_rank)
            if abs(maxvio - target_maxvio) <= abs_tolerance:
                break
            log_lo, log_hi = (log_mid, log_hi) if maxvio < target_maxvio else (log_lo, log_mid)
    assert best is not None
    return best
