"""The dense gated FFN as one autograd op (moontrain.model.ffn): the same function and gradients as the
nn.Linear composition, without keeping a = act(h, u) for backward."""

from __future__ import annotations

import pytest
import torch

from moontrain.model.ffn import GatedFFN, glu_activation


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_gated_ffn_matches_linear_composition_and_saves_no_activation(activation: str) -> None:
    """fp32 on the CPU: the forward is the composition op for op (bitwise); the gradients come from the
    activation's one-pass backward, which evaluates the same derivative in another operation order: within
    a few fp32 ulps of the composition's (bound 1e-5 relative to the gradient's scale, ~100 ulps). Saved for
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
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = b.abs().max()
        assert float((a - b).abs().max()) <= 1e-5 * float(scale), f"grad {name}: {float((a - b).abs().max())}"
