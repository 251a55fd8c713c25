"""One check of moonep.kernels.route_weights (the forward's route-weight scale) against torch.mul,
shared by the interpreted test (CPU) and the GPU test."""

from __future__ import annotations

import torch


def check_route_weights(device: str, *, exact_rounding: bool) -> None:
    """exact_rounding: the device rounds fp32 -> bf16 to nearest as torch does (a GPU), so the
    products are bitwise equal; Triton's interpreter truncates instead: within 1 bf16 ulp."""
    from moonep.kernels.route_weights import scale_rows

    g = torch.Generator().manual_seed(3)
    n, H = 37, 2500  # rows not a multiple of the row block; H spans chunks with a masked tail
    o = torch.randn(n, H, generator=g).to(torch.bfloat16).to(device)
    w = torch.rand(n, generator=g).to(device)

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
