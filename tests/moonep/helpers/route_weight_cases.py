"""One check of moonep.kernels.route_weights against the PyTorch specification (moonep.moe), shared
by the interpreted test (CPU) and the GPU test."""

from __future__ import annotations

import torch

from moonep.datapath.reference import route_backward as route_backward_ref


def check_route_weights(device: str, *, exact_rounding: bool) -> None:
    """exact_rounding: the device rounds fp32 -> bf16 to nearest as torch does (a GPU), so the
    products are bitwise equal; Triton's interpreter truncates instead: within 1 bf16 ulp."""
    from moonep.kernels.route_weights import route_backward, scale_rows

    g = torch.Generator().manual_seed(3)
    n, H = 37, 2500  # rows not a multiple of the row block; H spans chunks with a masked tail
    o = torch.randn(n, H, generator=g).to(torch.bfloat16).to(device)
    gy = torch.randn(n, H, generator=g).to(torch.bfloat16).to(device)
    w = torch.rand(n, generator=g).to(device)
    gy_wide = torch.zeros(n, H + 64, dtype=torch.bfloat16, device=device)  # a row stride != H
    gy_wide[:, :H] = gy
    gy_view = gy_wide[:, :H]

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if exact_rounding:
            assert torch.equal(got, want), f"{name}: differs from torch.mul"
        else:
            bound = want.float().abs() * 2.0**-7
            assert bool(((got.float() - want.float()).abs() <= bound).all()), f"{name}: beyond 1 bf16 ulp"

    y = torch.full((n, H), float("nan"), dtype=torch.bfloat16, device=device)
    scale_rows(o, w, y)
    same("y_rows", y, torch.mul(o, w[:, None], out=torch.empty_like(o)))
    grad_o, grad_w = route_backward(gy_view, o, w)
    want_o, want_w = route_backward_ref(gy, o, w)
    same("grad_o", grad_o, want_o)
    # grad_w: fp32 sums of the same exact products in another order; each partial sum rounds once,
    # so the two differ by at most 2 * H * eps * sum |gy * o| (a standard bound for any order)
    terms = (gy.float() * o.float()).abs().sum(-1)
    bound = 2 * H * torch.finfo(torch.float32).eps * terms
    assert grad_w.dtype == torch.float32 and bool(((grad_w - want_w).abs() <= bound).all()), "grad_w beyond bound"
    assert bool((want_w.abs() > 0).any()), "the check needs nonzero grads"
