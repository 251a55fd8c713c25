"""expert_glu's elementwise backward and route-weight kernels and the masked weight-gradient
accumulation on GPU, against the PyTorch specification (moonep.moe's *_torch functions, an fp32 add)."""

from __future__ import annotations

import pytest
import torch

from moonep.activation import swiglu_backward as swiglu_backward_ref
from tests.moonep.helpers.accumulate_cases import check_accumulate_groups, check_accumulate_groups_write
from tests.moonep.helpers.route_weight_cases import check_route_weights

pytestmark = pytest.mark.gpu


def test_swiglu_backward_kernel_gpu() -> None:
    from moonep.kernels.swiglu import swiglu_backward

    g = torch.Generator(device="cuda").manual_seed(0)
    N, F = 4099, 1024
    h = (3 * torch.randn(N, F, device="cuda", generator=g)).to(torch.bfloat16)
    u = torch.randn(N, F, device="cuda", generator=g).to(torch.bfloat16)
    grad_a = torch.randn(N, F, device="cuda", generator=g).to(torch.bfloat16)
    got = swiglu_backward(grad_a, h, u)
    want = swiglu_backward_ref(grad_a, h, u)
    # both round the same fp32 formula to nearest; only the device exp's last bits differ from
    # torch.sigmoid's, which moves a rounding by one ulp in rare elements (two roundings for a)
    for name, a, b, ulps in zip(("grad_h", "grad_u", "a"), got, want, (1, 1, 2), strict=True):
        diff = (a.float() - b.float()).abs()
        bound = torch.maximum(a.float().abs(), b.float().abs()) * ulps * 2.0**-7
        assert bool((diff <= bound).all()), f"{name}: max diff {float(diff.max())}"
        assert float((a != b).float().mean()) < 0.02, f"{name}: {float((a != b).float().mean()):.3f} of elements differ"


def test_swiglu_forward_kernel_gpu() -> None:
    from moonep.kernels.swiglu import swiglu_forward

    g = torch.Generator(device="cuda").manual_seed(1)
    h = (3 * torch.randn(4099, 1024, device="cuda", generator=g)).to(torch.bfloat16)
    u = torch.randn(4099, 1024, device="cuda", generator=g).to(torch.bfloat16)
    got, want = swiglu_forward(h, u), torch.nn.functional.silu(h) * u
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= torch.maximum(got.float().abs(), want.float().abs()) * 2 * 2.0**-7).all())
    assert float((got != want).float().mean()) < 0.02


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_accumulate_groups_gpu(scale: float) -> None:
    check_accumulate_groups([3, 0, 16, 0, 0, 1, 64, 0], 256, 1024, scale, "cuda")


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_accumulate_groups_writes_stale_groups_gpu(scale: float) -> None:
    check_accumulate_groups_write([3, 0, 16, 0, 0, 1, 64, 0], 4, 256, 1024, scale, "cuda")


def test_route_weight_kernels_gpu() -> None:
    """y_rows and grad_o bitwise equal torch.mul's; grad_w within the reordered-sum bound."""
    check_route_weights("cuda", exact_rounding=True)
