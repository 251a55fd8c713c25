"""The dense gated FFN as one autograd op (moontrain.model.ffn): the same function and gradients as the
nn.Linear composition, without keeping a = act(h, u) for backward."""

from __future__ import annotations

import pytest
import torch

from moontrain.model.ffn import GatedFFN, glu_activation


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_gated_ffn_matches_linear_composition_and_saves_no_activation(activation: str) -> None:
    """fp32 on the CPU: the forward is the composition op for op, and the backward too (the activation's
    specification is autograd's own derivative, the GEMMs nn.Linear's): every grad bitwise. Saved for
    backward: x, the three weights, h and u; nothing shaped like a (autograd's composition saves a too)."""
    torch.manual_seed(0)
    dim, hidden = 24, 40
    ffn = GatedFFN(dim, hidden, activation)
    for p in ffn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 7, dim, requires_grad=True)
    gy = torch.randn(3, 7, dim)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = ffn(x)
    assert saved.count((3, 7, hidden)) == 2, saved  # h and u; a is recomputed
    got = torch.autograd.grad(y, (x, *ffn.parameters()), gy)

    ref_y = ffn.w_down(glu_activation(activation, ffn.w_gate(x), ffn.w_up(x)))
    want = torch.autograd.grad(ref_y, (x, *ffn.parameters()), gy)
    assert torch.equal(y, ref_y)
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), f"grad {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_gated_ffn_bf16_on_cuda_matches_fp64(activation: str) -> None:
    """bf16 on CUDA (the backward through moonep.kernels.glu_route with unit row weights): the op's grads
    are no further from the fp64 composition's than the bf16 composition's (autograd over nn.Linear and
    the activation) are, up to a factor 2 and one bf16 ulp of the gradient's scale."""
    dev = torch.device("cuda")
    torch.manual_seed(1)
    dim, hidden = 512, 1024
    ffn = GatedFFN(dim, hidden, activation, device=dev)
    for p in ffn.parameters():
        torch.nn.init.normal_(p, std=dim**-0.5)
    x = torch.randn(4, 256, dim, device=dev)
    gy = torch.randn(4, 256, dim, device=dev)

    def grads(dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
        f = GatedFFN(dim, hidden, activation, device=dev).to(dtype)
        f.load_state_dict(ffn.state_dict())
        xi = x.to(dtype).requires_grad_()
        y = f(xi) if fused else f.w_down(glu_activation(activation, f.w_gate(xi), f.w_up(xi)))
        return [t.double() for t in torch.autograd.grad(y, (xi, *f.parameters()), gy.to(dtype))]

    exact, ours, theirs = grads(torch.float64, False), grads(torch.bfloat16, True), grads(torch.bfloat16, False)
    for name, e, a, b in zip(("x", "w_gate", "w_up", "w_down"), exact, ours, theirs, strict=True):
        err_ours, err_theirs = float((a - e).abs().max()), float((b - e).abs().max())
        assert err_ours <= 2 * err_theirs + 2.0**-8 * float(e.abs().max()), f"grad {name}: {err_ours} vs {err_theirs}"
