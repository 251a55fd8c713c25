"""The forced router skew (Router.set_skew, a benchmark's setting) against explicit references.

- sigma = 0: the router's choices and weights are bitwise those of the plain formula (and after a
  set_skew round trip back to 0);
- sigma > 0: the choices are top-k of (scores + score bias + sigma * z) with z ~ N(0,1) from
  SKEW_SEED, drawn independently here in float64; the weights stay the unbiased scores (bitwise);
- the realised expert maxvio of one fixed batch rises strictly over a ladder of sigmas and reaches
  the ceiling E/K - 1 (the K most popular experts take every token) when the skew dominates.

Everything here is integer choices or the same fp32 ops in the same order, so comparisons are exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from moontrain.metrics.balance import maxvio_L
from moontrain.model.config import ModelConfig
from moontrain.model.router import SKEW_SEED, Router

E, K, D = 16, 2, 32


def _cfg(**over) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=D, num_layers=2, dense_intermediate_size=64, num_heads=2, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=E,
                num_experts_per_tok=K, num_shared_experts=0, moe_intermediate_size=128, moe_latent_size=16,
                routed_scaling_factor=2.5)
    return ModelConfig(**{**base, **over})


def _router(sigma: float) -> Router:
    r = Router(_cfg())
    r.set_skew(sigma)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, D, generator=torch.Generator().manual_seed(0)) * 0.3)
        r.score_bias_E.copy_(torch.linspace(-1e-3, 1e-3, E))
    return r


def _batch(tokens: int = 4096) -> torch.Tensor:
    return torch.randn(tokens, D, generator=torch.Generator().manual_seed(1))


def _reference(r: Router, x_sD: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores_sE = torch.sigmoid(F.linear(x_sD.float(), r.weight.float()))
    select_sE = scores_sE + r.score_bias_E
    if sigma:
        z_E = torch.randn(E, generator=torch.Generator().manual_seed(SKEW_SEED), dtype=torch.float64)
        select_sE = select_sE + (sigma * z_E).float()
    topk_sK = select_sE.topk(K, dim=-1).indices
    w_sK = scores_sE.gather(1, topk_sK)
    return w_sK / w_sK.sum(-1, keepdim=True) * r.scaling, topk_sK


def _first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    idx = (got != want).nonzero()
    return "none" if idx.numel() == 0 else f"at {idx[0].tolist()}: {got[tuple(idx[0])]} vs {want[tuple(idx[0])]}"


def test_zero_skew_is_bitwise_the_plain_router() -> None:
    r = _router(0.0)
    x = _batch()
    w_ref, topk_ref = _reference(r, x, 0.0)
    w, topk, _ = r(x, batch=1)
    assert torch.equal(topk, topk_ref), _first_mismatch(topk, topk_ref)
    assert torch.equal(w, w_ref), _first_mismatch(w, w_ref)
    r.set_skew(0.7)
    r.set_skew(0.0)
    w2, topk2, _ = r(x, batch=1)
    assert torch.equal(topk2, topk_ref) and torch.equal(w2, w_ref)


@pytest.mark.parametrize("sigma", [0.01, 0.1, 1.0])
def test_skew_enters_selection_only(sigma: float) -> None:
    x = _batch()
    direct = _router(sigma)
    w_ref, topk_ref = _reference(direct, x, sigma)
    reset = _router(0.7)  # another skew first: set_skew replaces it
    reset.set_skew(sigma)
    for r in (direct, reset):
        w, topk, _ = r(x, batch=1)
        assert torch.equal(topk, topk_ref), _first_mismatch(topk, topk_ref)
        assert torch.equal(w, w_ref), _first_mismatch(w, w_ref)
    assert not torch.equal(topk_ref, _reference(direct, x, 0.0)[1])  # the skew did change choices
    assert "skew_bias_E" not in direct.state_dict()  # a benchmark's setting, never checkpointed


def test_maxvio_rises_with_skew() -> None:
    x = _batch()
    sigmas = [0.0, 0.03, 0.1, 0.3, 1.0]
    realised = []
    for sigma in sigmas:
        r = _router(sigma)
        r(x, batch=1)
        realised.append(maxvio_L(r.tokens_per_expert_E[None]).item())
    assert all(a < b for a, b in itertools.pairwise(realised)), list(zip(sigmas, realised, strict=True))
    assert realised[0] < 1.0 and realised[-1] > 6.0, realised  # from mild imbalance to near the ceiling 7
    r = _router(100.0)
    r(x, batch=1)
    z_E = torch.randn(E, generator=torch.Generator().manual_seed(SKEW_SEED), dtype=torch.float64)
    hot = set(z_E.topk(K).indices.tolist())
    assert set(r.tokens_per_expert_E.nonzero().flatten().tolist()) == hot
    assert maxvio_L(r.tokens_per_expert_E[None]).item() == E / K - 1


def test_negative_skew_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"router skew must be >= 0"):
        _router(0.0).set_skew(-1.0)
