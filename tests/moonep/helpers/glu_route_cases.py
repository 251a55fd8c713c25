"""One check of moonep.kernels.glu_route (expert_glu's elementwise backward with the route weights
folded in) against its specification, moonep.datapath.reference.glu_route_backward; shared by the
interpreted test (CPU) and the GPU test."""

from __future__ import annotations

import torch

from moonep.datapath.reference import glu_route_backward as spec


def glu_route_inputs(activation: str, N: int, F: int, device: str, seed: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 g, h, u [N, F] and fp32 route weights [N] with zeros (padding rows carry weight 0)."""
    from tests.moonep.helpers.situ_glu_cases import situ_inputs

    gen = torch.Generator().manual_seed(seed)
    if activation == "situ_glu":  # both caps' saturation, the Taylor range, sigmoid's tails
        h, u, g = situ_inputs(seed, N, F)
    else:
        h = (3 * torch.randn(N, F, generator=gen)).to(torch.bfloat16)
        u = torch.randn(N, F, generator=gen).to(torch.bfloat16)
        g = torch.randn(N, F, generator=gen).to(torch.bfloat16)
    w = torch.rand(N, generator=gen)
    w[::7] = 0.0
    return g.to(device), h.to(device), u.to(device), w.to(device)


def check_glu_route(activation: str, got: tuple, g: torch.Tensor, h: torch.Tensor, u: torch.Tensor,
                    w: torch.Tensor, *, bitwise: bool) -> None:
    """got = the kernel's (grad_h, grad_u, a_w, grad_w). bitwise: the bf16 outputs equal the
    specification's bit for bit (same exp on both sides); else within ulps: each is one fp32 value
    rounded once (a_w twice: a, then w * a; swiglu's a three times, silu first), and the device's exp
    or torch.sigmoid may move a rounding by one ulp. grad_w sums the same fp32 products in another
    order (any order is within 2 F eps sum |g a| of another); where a itself may differ by the ulps
    above, that adds up to ulps * 2^-7 * sum |g a|."""
    want = spec(activation, g, h, u, w)
    ulps = {"grad_h": 1, "grad_u": 1, "a_w": 3 if activation == "swiglu" else 2}
    for name, a, b in zip(("grad_h", "grad_u", "a_w"), got[:3], want[:3], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, name
        if bitwise:  # values below fp32's normal range: the interpreter's subnormal arithmetic is numpy's
            normal = torch.maximum(a.float().abs(), b.float().abs()) >= torch.finfo(torch.float32).tiny
            bad = ((a.view(torch.int16) != b.view(torch.int16)) & normal).nonzero()
            assert bad.numel() == 0, f"{activation} {name}: {bad.shape[0]} elements differ"
            assert bool(((a.float() - b.float()).abs() <= 2.0**-120).all()), f"{activation} {name}: subnormals"
        else:
            diff = (a.float() - b.float()).abs()
            bound = torch.maximum(a.float().abs(), b.float().abs()) * ulps[name] * 2.0**-7
            assert bool((diff <= bound).all()), f"{activation} {name}: max diff {float(diff.max())}"
    grad_w, want_w = got[3], want[3]
    F = h.shape[1]
    a = spec(activation, g, h, u, torch.ones_like(w))[2]  # a itself (w = 1)
    terms = (g.float() * a.float()).abs().sum(-1)
    bound = 2 * F * torch.finfo(torch.float32).eps * terms + (0 if bitwise else ulps["a_w"] * 2.0**-7) * terms
    assert grad_w.dtype == torch.float32 and grad_w.shape == want_w.shape
    assert bool(((grad_w - want_w).abs() <= bound).all()), f"{activation} grad_w beyond bound"
    assert bool((want_w.abs() > 0).any()), "the check needs nonzero grads"
    # the rows of weight 0 (padding) give zero grads of h, u and W_down's input
    zero = w == 0
    for name, t in zip(("grad_h", "grad_u", "a_w"), got[:3], strict=True):
        assert bool((t[zero] == 0).all()), f"{activation} {name}: rows of weight 0 must be zero"
