"""expert_glu's elementwise backward and route-weight kernels and the masked weight-gradient
accumulation on GPU, against the PyTorch specification (moonep.moe's *_torch functions, an fp32 add)."""

from __future__ import annotations

import pytest
import torch

from tests.moonep.helpers.accumulate_cases import check_accumulate_groups, check_accumulate_groups_write
from tests.moonep.helpers.glu_route_cases import check_glu_route, glu_route_inputs
from tests.moonep.helpers.route_weight_cases import check_route_weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_glu_route_kernel_gpu(activation: str) -> None:
    """At an expert width's size (F = 1024): the device's exp and division move a rounding by an ulp at
    most (tests/moonep/helpers/glu_route_cases.py); few elements differ at all."""
    from moonep.datapath.reference import glu_route_backward as spec
    from moonep.kernels.glu_route import glu_route_backward

    g, h, u, w = glu_route_inputs(activation, 4099, 1024, "cuda")
    got = glu_route_backward(activation, g, h, u, w)
    check_glu_route(activation, got, g, h, u, w, bitwise=False)
    want = spec(activation, g, h, u, w)
    for name, a, b in zip(("grad_h", "grad_u", "a_w"), got[:3], want[:3], strict=True):
        assert float((a != b).float().mean()) < 0.02, f"{name}: {float((a != b).float().mean()):.3f} of elements differ"


def test_glu_forward_rows_swiglu_gpu() -> None:
    from moonep.kernels.glu_rows import glu_forward_rows

    g = torch.Generator(device="cuda").manual_seed(1)
    h = (3 * torch.randn(4099, 896, device="cuda", generator=g)).to(torch.bfloat16)
    u = torch.randn(4099, 896, device="cuda", generator=g).to(torch.bfloat16)
    got, want = glu_forward_rows("swiglu", torch.cat([h, u], dim=1)), torch.nn.functional.silu(h) * u
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
