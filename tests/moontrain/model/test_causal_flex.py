"""causal_flex_mask: deterministic mode's attention without documents (flex_attention with the plain causal
block mask) against SDPA with is_causal; and the layers reading a DocumentMask without document ids as one
document per row (MLA with QK-Clip's max logit, KDA: bitwise their output without any mask).

flex_attention runs eagerly on the CPU here, forward only (torch has no CPU flex backward; the CUDA path
compiles it, and test_determinism_gpu.py checks its gradients against SDPA). Tolerance: both sides
compute softmax attention in fp32 on the same inputs, differing only in the summation order, so 1e-5
relative to the values' scale (a few hundred roundings of 2^-24 each).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import moontrain.model.documents as documents
from moontrain.model.attention import MLAttention
from moontrain.model.config import ModelConfig
from moontrain.model.documents import causal_attention, causal_flex_mask
from moontrain.model.kda.layer import KimiDeltaAttention
from moontrain.model.rope import rope_cos_sin

CPU = torch.device("cpu")


@pytest.fixture
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    def unfused(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
            return flex_attention(*args, **kwargs)

    monkeypatch.setattr(documents, "compiled_flex_attention", lambda: unfused)


def _cfg(**over) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_dense_layers=1, dense_intermediate_size=64,
                num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                use_nope=False, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=128,
                moe_latent_size=16, kda_layers_per_mla=1, kda_num_heads=3, kda_head_dim=8)
    return ModelConfig(**{**base, **over})


def test_causal_flex_mask_is_causal_sdpa(eager_flex: None) -> None:
    gen = torch.Generator().manual_seed(3)
    B, N, T = 2, 3, 200  # T not a multiple of flex's 128-token blocks
    q, k = (torch.randn(B, N, T, 12, generator=gen) for _ in range(2))
    v = torch.randn(B, N, T, 8, generator=gen)
    mask = causal_flex_mask(T, CPU)
    assert mask.start_BT is None and mask.id_BT is None and causal_flex_mask(T, CPU) is mask  # cached
    got = causal_attention(q, k, v, scale=0.3, docs=mask)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert torch.equal(causal_attention(q, k, v, scale=0.3, docs=None), want)  # no mask: SDPA itself
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5 * want.abs().max().item(), f"max |flex - sdpa| {diff:.3g}"


def test_layers_read_a_mask_without_ids_as_one_document(eager_flex: None) -> None:
    cfg = _cfg()
    gen = torch.Generator().manual_seed(5)
    T = 40
    x = torch.randn(2, T, cfg.hidden_size, generator=gen)
    cos, sin = rope_cos_sin(T, cfg.qk_rope_head_dim, cfg.rope_theta, CPU)
    mask = causal_flex_mask(T, CPU)

    torch.manual_seed(0)
    mla = MLAttention(cfg)
    outs, maxima = [], []
    with torch.no_grad():
        for docs in (mask, None):
            mla.max_logit_N = torch.zeros(cfg.num_heads)  # QK-Clip on: reads docs.id_BT
            outs.append(mla(x, cos, sin, docs))
            maxima.append(mla.max_logit_N)
        diff = (outs[0] - outs[1]).abs().max().item()
        assert diff <= 1e-5 * outs[1].abs().max().item(), f"MLA: max |flex - sdpa| {diff:.3g}"
        assert torch.equal(maxima[0], maxima[1]) and maxima[0].gt(0).all()

        kda = KimiDeltaAttention(cfg)
        kda.init_parameters(torch.Generator().manual_seed(1))
        assert torch.equal(kda(x, cos, sin, mask), kda(x, cos, sin, None))
