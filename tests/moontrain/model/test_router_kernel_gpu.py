"""moontrain.model.router_kernel on one GPU at k3_small's router shape (16,384 tokens, D 2,048, 64 experts, top-8):
the routing kernel against torch's ops on the same fp32 logits (the kernel's sigmoid is torch's, bitwise: libdevice
exp and a correctly rounded division, so the choices are torch.topk's and the chosen scores equal; where two chosen
values are exactly equal the kernel puts the lower expert first, torch.topk either), the counts
against bincount, and both routes of the router (kernels.router triton / torch) end to end: choices equal except
at near-ties of the logits (the two routes' logits GEMMs are different cuBLAS calls), gradients against float64
autograd through the kernel's own choices. Bounds as tests/moontrain/model/test_router_kernel_interpreted.py
derives them, with the GPU's round-to-nearest split of the logits' gradient (2^-16 of it)."""

from __future__ import annotations

import pytest
import torch

from moontrain.model.bf16_mm import mm
from moontrain.model.router import Router

pytestmark = pytest.mark.gpu

S, D, E, K = 16384, 2048, 64, 8
U = 2.0**-24


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(S, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(E, D, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(E, device="cuda", generator=gen) * 0.01
    return x, w, bias


def test_route_kernel_is_torchs_route_on_the_same_logits() -> None:
    from moontrain.model.router_kernel import routed_scores  # here: a *_interpreted module may set the interpreter

    x, w, bias = _inputs(0)
    counts = torch.zeros(E, dtype=torch.int64, device="cuda")
    weights, topk = routed_scores(x, w, bias, None, counts, K, 2.827)
    scores = torch.sigmoid(mm(x, w.t(), torch.float32))
    select = scores + bias
    want = torch.topk(select, K, dim=-1)
    # the same experts with the same values, largest first; among exactly equal values (torch.topk leaves their order
    # unspecified: one token in ~16k here) the kernel puts the lower expert first
    assert torch.equal(topk.sort(-1).values, want.indices.sort(-1).values), "the choices"
    assert torch.equal(select.gather(1, topk), want.values), "the order of the choices"
    tied = select.gather(1, topk)[:, 1:] == select.gather(1, topk)[:, :-1]
    assert bool((topk[:, 1:] > topk[:, :-1])[tied].all()), "equal values: the lower expert first"
    a = scores.gather(1, topk)  # in the kernel's order (equal selection values: the scores can differ)
    want_w = a / a.sum(-1, keepdim=True) * 2.827
    diff = (weights - want_w).abs().max().item()
    assert diff <= 4 * (K + 6) * U * want_w.abs().max().item(), f"weights: max |diff| {diff:.3g}"
    assert torch.equal(counts, torch.bincount(topk.flatten(), minlength=E))


def test_router_routes_agree_and_the_kernels_gradients_match_float64() -> None:
    x, w, bias = _inputs(1)
    g = torch.randn(S, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    out = {}
    for kernel in ("torch", "triton"):
        r = Router(_cfg(), kernel=kernel, device="cuda")
        r.weight.data = w.clone()
        with torch.no_grad():
            r.score_bias_E.copy_(bias)
        xr = x.clone().requires_grad_()
        weights, topk, _ = r(xr, batch=4)
        (weights * g).sum().backward()
        out[kernel] = (weights, topk, xr.grad, r.weight.grad, r.tokens_per_expert_E.clone())
    (_, t_ref, *_), (_, t_ker, gx, gw, counts) = out["torch"], out["triton"]
    differ = (t_ref.sort(-1).values != t_ker.sort(-1).values).any(-1)  # the sets (equal values: any order)
    select = torch.sigmoid(mm(x, w.t(), torch.float32)) + bias
    top = select.topk(K + 1, dim=-1).values
    gap = top[:, K - 1] - top[:, K]
    assert (gap[differ] <= 1e-5).all(), f"choices differ away from a near-tie: gaps {gap[differ].tolist()}"
    assert torch.equal(counts, torch.bincount(t_ker.flatten(), minlength=E))

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    logits64 = x64 @ w64.T
    logits64.retain_grad()
    a = torch.sigmoid(logits64).gather(1, t_ker)
    w_sK = a / a.sum(-1, keepdim=True) * 2.827
    (w_sK * g.double()).sum().backward()
    gl = logits64.grad.abs()
    for name, got, want, mag in (("grad x", gx, x64.grad, gl @ w64.detach().abs()),
                                 ("grad w", gw, w64.grad, gl.T @ x64.detach().abs())):
        diff = (got.double() - want).abs().max().item()
        tol = 2**-8 * want.abs().max().item() + 2**-15 * mag.max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def _cfg():
    from moontrain.model.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=D, num_layers=2, dense_intermediate_size=64, num_heads=2,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       num_experts=E, num_experts_per_tok=K, num_shared_experts=0, moe_intermediate_size=896,
                       moe_latent_size=1024, routed_scaling_factor=2.827)
