"""Model pieces against explicit references: MLA through SDPA vs a hand-written causal softmax attention,
the router's renormalised top-k and its aux-loss-free bias update, the sequence aux loss formula, and
the latent MoE layer against a per-token loop.

Tolerance: the references compute the same fp32 math in another order; 1e-5 relative to the largest
value (~100 ulps of the accumulated magnitude) bounds the reordering error.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moontrain.model.attention import MLAttention
from moontrain.model.config import ModelConfig
from moontrain.model.experts import ExpertsContext
from moontrain.model.moe import MoE
from moontrain.model.rope import apply_rope, rope_cos_sin
from moontrain.model.router import Router, RouterLogits

RTOL = 1e-5


def _cfg(**over) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, dense_intermediate_size=64, num_heads=2, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=8,
                num_experts_per_tok=3, num_shared_experts=2, moe_intermediate_size=128, moe_latent_size=16,
                routed_scaling_factor=2.5, seq_aux_loss_coef=0.1)
    return ModelConfig(**{**base, **over})


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff, tol = (got - ref).abs().max().item(), RTOL * ref.abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"


def _init(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _attention_reference(m: MLAttention, x_BTD: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    B, T, _ = x_BTD.shape
    N, Dn, Dr, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = m.wq_b(m.q_norm(m.wq_a(x_BTD))).view(B, T, N, Dn + Dr)
    c, k_rope = m.wkv_a(x_BTD).split([cfg.kv_lora_rank, Dr], -1)
    kv = m.wkv_b(m.kv_norm(c)).view(B, T, N, Dn + Dv)
    k_nope, v = kv.split([Dn, Dv], -1)
    cos, sin = rope_cos_sin(T, Dr, cfg.rope_theta, x_BTD.device)
    out = torch.zeros(B, T, N, Dv)
    for b in range(B):
        for n in range(N):
            q_rope = q[b, :, n, Dn:] if cfg.use_nope else apply_rope(q[b, :, n, Dn:], cos, sin)
            kr = k_rope[b] if cfg.use_nope else apply_rope(k_rope[b], cos, sin)
            qq = torch.cat([q[b, :, n, :Dn], q_rope], -1)
            kk = torch.cat([k_nope[b, :, n], kr], -1)
            scores = qq @ kk.T / math.sqrt(Dn + Dr)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            out[b, :, n] = scores.softmax(-1) @ v[b, :, n]
    o = out.reshape(B, T, N * Dv)
    if cfg.attn_output_gate:
        o = o * torch.sigmoid(m.wg(x_BTD))
    return m.wo(o)


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("use_nope", "dims"), [
    (False, {}),  # q/k head dim 8 + 4 = 12 > v head dim 8 (padded: v is padded)
    (True, {}),
    (False, {"qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 16}),  # v wider (padded: q/k are)
], ids=["rope", "nope", "wide-v"])
def test_mla_matches_explicit_attention(use_nope: bool, dims: dict, pad: bool) -> None:
    cfg = _cfg(use_nope=use_nope, **dims)
    m = MLAttention(cfg, pad_head_dims=pad)
    _init(m)
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(7, cfg.qk_rope_head_dim, cfg.rope_theta, x.device)
    _close(m(x, cos, sin), _attention_reference(m, x, cfg), "attention output")


def test_nope_ignores_position_in_rope_dims() -> None:
    """With use_nope, shifting a (causally complete) prefix by position cannot change it: check the
    first token's output does not depend on rope_theta."""
    outs = []
    for theta in (100.0, 1e6):
        cfg = _cfg(use_nope=True, rope_theta=theta)
        m = MLAttention(cfg)
        _init(m)
        x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        cos, sin = rope_cos_sin(5, cfg.qk_rope_head_dim, theta, x.device)
        outs.append(m(x, cos, sin))
    assert torch.equal(outs[0], outs[1])


def test_router_topk_renormalised_and_scaled() -> None:
    cfg = _cfg()
    r = Router(cfg)
    _init(r)
    with torch.no_grad():
        r.score_bias_E.copy_(torch.linspace(-0.2, 0.2, cfg.num_experts))
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, topk, _ = r(x, batch=2)
    scores = torch.sigmoid(x @ r.weight.T)
    want_topk = (scores + r.score_bias_E).topk(cfg.num_experts_per_tok, -1).indices
    assert torch.equal(topk, want_topk)
    chosen = scores.gather(1, want_topk)
    _close(weights, chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor, "route weights")
    assert torch.equal(r.tokens_per_expert_E, torch.bincount(want_topk.flatten(), minlength=cfg.num_experts))


def _router_logits_case(s: int, D: int, E: int, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    """bf16 activations, fp32 weights at the router's init scale, fp32 logit grads."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(s, D, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(E, D, device=device, generator=gen) * 0.02).requires_grad_()
    g = torch.randn(s, E, device=device, generator=gen)
    return x, w, g


def _router_logits_and_grads(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = RouterLogits.apply(x, w)
    return (logits, *torch.autograd.grad(logits, (x, w), g))


def _check_router_logits(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, logits: torch.Tensor, gx: torch.Tensor,
                         gw: torch.Tensor) -> None:
    """RouterLogits (kernels.router_gemm=split_bf16) against float64 with bounds derived from its rounding
    (bf16's unit roundoff u = 2^-8, fp32's 2^-24): w = w_hi + w_lo within u^2 |w| = 2^-16 |w|, the bf16
    products exact in fp32, a sum of n terms within n 2^-24 of sum |terms|. Logits: 2^-16 + (D + 1) 2^-24 of
    |x| |w|^T; grad_x: its one rounding to bf16 (2^-8 of the value) plus three dropped terms of 2^-16 each;
    grad_w: 2^-16 + (s + 1) 2^-24 of |g|^T |x|. Each bound twice the derived value. Dropping the lo halves
    (plain bf16 operands) breaks them: errors of 2^-8 |x| |w|."""
    assert (logits.dtype, gx.dtype, gw.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    s, D = x.shape
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    u = 2.0 ** -24
    assert ((logits.double() - xd @ wd.t()).abs() <= 2 * (2.0 ** -16 + (D + 1) * u) * (xd.abs() @ wd.abs().t())).all()
    ref_gx = gd @ wd
    assert ((gx.double() - ref_gx).abs() <= 2 * (2.0 ** -8 * ref_gx.abs() + 3 * 2.0 ** -16 * (gd.abs() @ wd.abs()))).all()
    assert ((gw.double() - gd.t() @ xd).abs() <= 2 * (2.0 ** -16 + (s + 1) * u) * (gd.abs().t() @ xd.abs())).all()


def test_router_logits_split_bf16_within_derived_bounds() -> None:
    """The split-bf16 router GEMMs' specification (moontrain.model.bf16_mm.mm on the CPU: the same bf16 products
    summed in fp32) against float64: module docstring of _check_router_logits."""
    x, w, g = _router_logits_case(257, 96, 8, "cpu", 5)
    _check_router_logits(x, w, g, *_router_logits_and_grads(x, w, g))


def test_router_logits_keep_bf16_input_for_backward() -> None:
    """A bf16 router input is saved as it is (an fp32 copy would be [s, D] fp32 per MoE layer kept until
    backward), with the weight's two bf16 halves."""
    x, w, _ = _router_logits_case(37, 24, 8, "cpu", 7)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        RouterLogits.apply(x, w)
    assert saved == [(torch.bfloat16, (37, 24)), (torch.bfloat16, (8, 24)), (torch.bfloat16, (8, 24))], saved


@pytest.mark.gpu
def test_router_logits_split_bf16_on_cuda() -> None:
    """CUDA (cuBLAS's bf16 GEMMs with fp32 accumulation), the shapes of a 4096-token pass at D 2048 and E 192:
    the derived bounds of _check_router_logits, and no op of forward or backward makes an fp32 tensor of x's
    size (the copies the fp32 and TF32 routes made)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, g = _router_logits_case(4096, 2048, 192, "cuda", 6)
    big_fp32 = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= x.numel():
                    big_fp32.append(str(func))
            return out

    with Watch():
        got = _router_logits_and_grads(x, w, g)
    assert not big_fp32, big_fp32
    _check_router_logits(x, w, g, *got)


@pytest.mark.gpu
def test_unpadded_attention_matches_padded_on_cuda() -> None:
    """bf16 on CUDA, the recipe's head dims (q/k 192, v 128): SDPA at unequal head dims (cuDNN or
    memory-efficient) against the zero-padded call, output and input grad within bf16 tolerance."""
    dev = torch.device("cuda")
    dims = dict(hidden_size=256, num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128)
    outs = []
    for pad in (False, True):
        cfg = _cfg(**dims)
        torch.manual_seed(0)
        m = MLAttention(cfg, pad_head_dims=pad, device=dev).to(torch.bfloat16)
        x = torch.randn(2, 512, cfg.hidden_size, device=dev, generator=torch.Generator(device=dev).manual_seed(1),
                        dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rope_cos_sin(512, cfg.qk_rope_head_dim, cfg.rope_theta, dev)
        y = m(x, cos, sin)
        (gx,) = torch.autograd.grad(y.float().square().sum(), (x,))
        outs.append((y.float(), gx.float()))
    for a, b, what in zip(outs[0], outs[1], ("output", "grad x"), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=what)


@pytest.mark.parametrize("rule, want", [
    ("sign", [-0.01, 0.01, 0, 0, 0, 0, 0.01, -0.01]),  # 0.01 * sign(5 - count)
    ("proportional", [-0.01, 0.01, 0, 0, 0, 0, 0.004, -0.004]),  # 0.01 * (5 - count) / 5
])
def test_bias_update_moves_toward_balance(rule: str, want: list[float]) -> None:
    cfg = _cfg(router_bias_update_rate=0.01, router_bias_update=rule)
    r = Router(cfg)
    counts = torch.tensor([10, 0, 5, 5, 5, 5, 3, 7])  # mean 5
    r.tokens_per_expert_E.fill_(1)
    r.update_bias(counts)
    assert r.score_bias_E.tolist() == pytest.approx(want, abs=1e-7)
    assert r.tokens_per_expert_E.abs().sum() == 0


def test_sequence_aux_loss_formula() -> None:
    cfg = _cfg()
    r = Router(cfg)
    _init(r)
    B, T, E, K = 2, 5, cfg.num_experts, cfg.num_experts_per_tok
    x = torch.randn(B * T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    _, topk, aux = r(x, batch=B)
    scores = torch.sigmoid(x @ r.weight.T)
    want = 0.0
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        p = (scores[rows] / scores[rows].sum(-1, keepdim=True)).mean(0)
        f = torch.stack([(topk[rows] == e).sum() for e in range(E)]).float() * E / (K * T)
        want += (f * p).sum() / B
    _close(aux, cfg.seq_aux_loss_coef * want, "seq aux loss")


def _situ_glu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_latent_moe_matches_per_token_loop(activation: str) -> None:
    cfg = _cfg(ffn_activation=activation)
    act = _situ_glu_reference if activation == "situ_glu" else (lambda g, u: F.silu(g) * u)
    moe = MoE(cfg, ep_rank=0, ep=1)
    _init(moe)
    from moontrain.model.experts import build_experts_runtime

    moe.backend = build_experts_runtime("local", ExpertsContext(
        num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep=1,
        compute_dtype=torch.float32, token_padding=8, max_tokens=12,
        device=torch.device("cpu"), activation=activation)).layer(moe.experts)
    x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    y, _ = moe(x)
    x_sD = x.view(12, -1)
    weights, topk, _ = moe.router(x_sD, batch=2)
    h = moe.latent_norm(moe.latent_down(x_sD))
    w = {k: v.detach() for k, v in moe.experts.master.items()}
    w["gate"], w["up"] = w.pop("gate_up").split(moe.experts.intermediate, dim=2)
    routed = torch.zeros_like(h)
    for t in range(12):
        for k in range(cfg.num_experts_per_tok):
            e = topk[t, k]
            routed[t] += weights[t, k] * (act(h[t] @ w["gate"][e], h[t] @ w["up"][e]) @ w["down"][e])
    sw = moe.shared
    want = moe.latent_up(routed) + sw.w_down(act(sw.w_gate(x_sD), sw.w_up(x_sD)))
    _close(y.view(12, -1), want, "moe output")


@pytest.mark.parametrize("variant", ["standard", "situ_attnres", "kda-hybrid-documents"])
def test_activation_checkpointing_same_grads_and_counts_once(variant: str) -> None:
    """Recomputed blocks give bitwise the same grads, every layer recomputed or some (layers 0 and 2 of 3, beside
    a kept one); with SiTU-GLU and AttnRes (block size 2: a block per layer, so every recompute reads a different
    tuple of completed blocks) too, and with the KDA hybrid layout over packed documents."""
    from moontrain.model.transformer import K3Model

    extra = {"standard": {}, "situ_attnres": dict(ffn_activation="situ_glu", attn_res_block_size=2),
             "kda-hybrid-documents": dict(kda_layers_per_mla=1, kda_head_dim=8)}[variant]
    cfg = _cfg(num_dense_layers=1, num_layers=3, **extra)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    if variant == "kda-hybrid-documents":
        tokens[:, 3] = 7  # an end of document
    grads, counts = [], []
    for ac in ((), None, (0, 2)):  # none, every layer, some
        model = K3Model(cfg, document_eos_id=7 if variant == "kda-hybrid-documents" else None)
        model.init_weights(seed=0)
        model.attach_experts_backends("local", ExpertsContext(
            num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep=1,
            compute_dtype=torch.float32, token_padding=8, max_tokens=18, device=torch.device("cpu"),
            activation=cfg.ffn_activation))
        if variant == "situ_attnres":  # non-zero pseudo-queries: depth weights that are not uniform
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(".query"):
                        p.normal_(generator=torch.Generator().manual_seed(len(name)))
        if ac != ():
            model.enable_activation_checkpointing(ac)
        assert [b.activation_checkpointing for b in model.layers] == [ac is None or i in ac for i in range(3)]
        loss, _ = model(tokens, tokens.roll(-1, 1))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                     | {f"{i}.{k}": g.clone() for i, m in enumerate(model.moe_layers()) for k, g in m.experts.grad.items()})
        counts.append([m.router.tokens_per_expert_E.clone() for m in model.moe_layers()])
    for run in (1, 2):
        assert grads[0].keys() == grads[run].keys()
        for name, g in grads[0].items():
            assert torch.equal(grads[run][name], g), f"{name} differs under activation checkpointing (run {run})"
        for c0, c1 in zip(counts[0], counts[run], strict=True):
            assert int(c0.sum()) == 18 * cfg.num_experts_per_tok and torch.equal(c0, c1)
