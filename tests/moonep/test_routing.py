"""moonep.routing: maxvio metrics and the target-maxvio routing generator (docs/moonep.md §9).

Shape legend: R ranks, s tokens per rank, E routed experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch

from moonep.routing import (
    RoutingResult,
    expert_maxvio,
    generate_routing,
    group_loads,
    max_maxvio,
    rank_load,
    rank_maxvio,
)


def _route(
    target: float, *, num_experts: int = 96, tokens_per_rank: int = 512, seed: int = 0
) -> RoutingResult:
    return generate_routing(
        num_ranks=2,
        tokens_per_rank=tokens_per_rank,
        num_experts=num_experts,
        topk=8,
        target_maxvio=target,
        seed=seed,
    )


def _assert_distinct_experts(topk_RsK: torch.Tensor) -> None:
    sorted_RsK = topk_RsK.sort(dim=-1).values
    repeats = (sorted_RsK[..., 1:] == sorted_RsK[..., :-1]).nonzero()
    assert repeats.numel() == 0, f"first token with a repeated expert (rank, token, k): {repeats[0].tolist()}"


def _assert_histograms_match(result: RoutingResult, num_experts: int) -> None:
    for rank_idx in range(result.topk_RsK.shape[0]):
        topk_sK, tokens_per_expert_E = result.for_rank(rank_idx)
        expected_E = torch.bincount(topk_sK.flatten().long(), minlength=num_experts).to(torch.int32)
        assert torch.equal(tokens_per_expert_E, expected_E), f"rank {rank_idx} histogram != bincount"


def test_metrics_on_hand_computed_histograms() -> None:
    assert expert_maxvio(torch.tensor([3, 1, 0, 0])) == 2.0  # mean 1, hottest 3
    assert expert_maxvio([5, 5, 5]) == 0.0
    assert rank_load(torch.tensor([4, 2])) == (4.0, 3.0)
    assert rank_maxvio([4, 2]) == pytest.approx(1 / 3, rel=1e-15)
    assert rank_maxvio([7, 7, 7, 7]) == 0.0
    assert group_loads(torch.tensor([1, 2, 3, 4, 5, 6]), 3).tolist() == [3, 7, 11]
    assert max_maxvio(96, 8) == 11.0
    assert max_maxvio(384, 8) == 47.0


def test_metric_errors() -> None:
    with pytest.raises(ValueError, match=r"non-empty 1-D histogram, got shape \(0,\)"):
        expert_maxvio(torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="sums to 0; no tokens were routed"):
        expert_maxvio([0, 0, 0])
    with pytest.raises(ValueError, match="sums to 0"):
        rank_maxvio([0, 0])
    with pytest.raises(ValueError, match="E=6 experts are not a multiple of num_ranks=4"):
        group_loads(torch.arange(6), 4)
    with pytest.raises(ValueError, match="topk=9 exceeds num_experts=8"):
        max_maxvio(8, 9)


def test_round_robin_is_exactly_balanced() -> None:
    num_ranks, tokens_per_rank, num_experts, topk = 2, 384, 96, 8  # R*s*K = 6144 = 64 * E
    result = generate_routing(
        num_ranks=num_ranks,
        tokens_per_rank=tokens_per_rank,
        num_experts=num_experts,
        topk=topk,
        target_maxvio=0.0,
    )
    assert result.realised_maxvio == 0.0
    assert result.sigma == 0.0 and result.sampled_fraction == 0.0
    expected_ids = [
        [
            [((r * tokens_per_rank + t) * topk + k) % num_experts for k in range(topk)]
            for t in range(tokens_per_rank)
        ]
        for r in range(num_ranks)
    ]
    assert result.topk_RsK.dtype == torch.int32
    assert result.topk_RsK.tolist() == expected_ids
    global_E = result.tokens_per_expert_RE.sum(dim=0)
    assert torch.equal(global_E, torch.full((num_experts,), 64, dtype=torch.int64))
    _assert_histograms_match(result, num_experts)


def test_round_robin_not_divisible_reports_its_small_maxvio() -> None:
    # R*s*K = 8192 = 85*96 + 32: 32 experts get 86 tokens, the rest 85.
    result = _route(0.0)
    global_E = result.tokens_per_expert_RE.sum(dim=0)
    assert sorted(global_E.unique().tolist()) == [85, 86]
    assert int((global_E == 86).sum()) == 32
    assert result.realised_maxvio == 86 * 96 / 8192 - 1


@pytest.mark.parametrize(
    ("target", "num_experts", "expected_fraction"),
    [(0.2, 96, None), (1.0, 96, 1.0), (10.0, 96, 1.0), (20.0, 384, 1.0)],
)
def test_realised_maxvio_hits_target(
    target: float, num_experts: int, expected_fraction: float | None
) -> None:
    result = _route(target, num_experts=num_experts)
    tolerance = 0.02 * max(1.0, target)
    assert abs(result.realised_maxvio - target) <= tolerance, result
    global_E = result.tokens_per_expert_RE.sum(dim=0)
    assert result.realised_maxvio == expert_maxvio(global_E)
    assert result.topk_RsK.shape == (2, 512, 8) and result.topk_RsK.dtype == torch.int32
    assert result.tokens_per_expert_RE.shape == (2, num_experts)
    assert result.tokens_per_expert_RE.sum(dim=1).tolist() == [512 * 8, 512 * 8]
    _assert_distinct_experts(result.topk_RsK)
    _assert_histograms_match(result, num_experts)
    if expected_fraction is None:
        # 0.2 lies below the ~0.27 noise floor of uniform sampling at this size: part round-robin.
        assert 0.0 < result.sampled_fraction < 1.0
    else:
        assert result.sampled_fraction == expected_fraction
        assert result.sigma > 0.0


def test_max_maxvio_puts_one_expert_in_every_token() -> None:
    result = _route(max_maxvio(96, 8))
    assert result.realised_maxvio == 11.0
    global_E = result.tokens_per_expert_RE.sum(dim=0)
    hottest = int(global_E.argmax())
    assert int(global_E[hottest]) == 2 * 512
    assert bool((result.topk_RsK == hottest).any(dim=-1).all())


def test_skew_follows_one_shared_popularity() -> None:
    # Ranks sample from their own streams but from the same p: their histograms agree.
    tokens_per_expert_RE = _route(10.0).tokens_per_expert_RE
    correlation = torch.corrcoef(tokens_per_expert_RE.double())[0, 1].item()
    assert correlation > 0.95
    assert tokens_per_expert_RE[0].argmax() == tokens_per_expert_RE[1].argmax()


def test_same_seed_is_bitwise_deterministic_and_streams_differ() -> None:
    first, second = _route(1.0), _route(1.0)
    assert torch.equal(first.topk_RsK, second.topk_RsK)
    assert torch.equal(first.tokens_per_expert_RE, second.tokens_per_expert_RE)
    assert (first.sigma, first.realised_maxvio) == (second.sigma, second.realised_maxvio)
    assert not torch.equal(first.topk_RsK[0], first.topk_RsK[1]), "ranks must draw from their own streams"
    assert not torch.equal(first.topk_RsK, _route(1.0, seed=1).topk_RsK)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"topk": 97}, "topk=97 exceeds num_experts=96"),
        ({"target_maxvio": -0.5}, r"target_maxvio=-0.5 is outside \[0, E/K - 1\]"),
        ({"target_maxvio": 11.5}, r"largest reachable maxvio is E/K - 1 = 11"),
        ({"num_ranks": 0}, "num_ranks must be >= 1, got 0"),
        ({"tokens_per_rank": -1}, "tokens_per_rank must be >= 1, got -1"),
        ({"num_experts": 0}, "num_experts must be >= 1, got 0"),
        ({"topk": 0}, "topk must be >= 1, got 0"),
        ({"seed": -1}, "seed=-1 must be in"),
    ],
)
def test_generate_routing_rejects_bad_input(overrides: dict, message: str) -> None:
    kwargs = {
        "num_ranks": 2,
        "tokens_per_rank": 16,
        "num_experts": 96,
        "topk": 8,
        "target_maxvio": 1.0,
        "seed": 0,
    } | overrides
    with pytest.raises(ValueError, match=message):
        generate_routing(**kwargs)


@pytest.mark.gpu
def test_cuda_routing_equals_cpu_routing() -> None:
    cpu = _route(10.0)
    cuda = generate_routing(
        num_ranks=2, tokens_per_rank=512, num_experts=96, topk=8, target_maxvio=10.0, device="cuda"
    )
    assert cuda.topk_RsK.is_cuda
    assert torch.equal(cuda.topk_RsK.cpu(), cpu.topk_RsK)
    assert torch.equal(cuda.tokens_per_expert_RE.cpu(), cpu.tokens_per_expert_RE)
