"""expert_swiglu's elementwise backward kernel and the masked weight-gradient accumulation on GPU,
against the PyTorch specification (moonep.moe.swiglu_backward_torch, an fp32 add)."""

from __future__ import annotations

import pytest
import torch

from moonep.moe import swiglu_backward_torch

pytestmark = pytest.mark.gpu


def test_swiglu_backward_kernel_gpu() -> None:
    from moonep.kernels.swiglu import swiglu_backward

    g = torch.Generator(device="cuda").manual_seed(0)
    N, F = 4099, 1024
    h = (3 * torch.randn(N, F, device="cuda", generator=g)).to(torch.bfloat16)
    u = torch.randn(N, F, device="cuda", generator=g).to(torch.bfloat16)
    grad_a = torch.randn(N, F, device="cuda", generator=g).to(torch.bfloat16)
    got = swiglu_backward(grad_a, h, u)
    want = swiglu_backward_torch(grad_a, h, u)
    # both round the same fp32 formula to nearest; only the device exp's last bits differ from
    # torch.sigmoid's, which moves a rounding by one ulp in rare elements (two roundings for a)
    for name, a, b, ulps in zip(("grad_h", "grad_u", "a"), got, want, (1, 1, 2), strict=True):
        diff = (a.float() - b.float()).abs()
        bound = torch.maximum(a.float().abs(), b.float().abs()) * ulps * 2.0**-7
        assert bool((diff <= bound).all()), f"{name}: max diff {float(diff.max())}"
        assert float((a != b).float().mean()) < 0.02, f"{name}: {float((a != b).float().mean()):.3f} of elements differ"


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_accumulate_groups_gpu(scale: float) -> None:
    from moonep.kernels.experts import accumulate_groups

    gen = torch.Generator(device="cuda").manual_seed(1)
    G, n_in, n_out = 8, 256, 1024
    rows = torch.tensor([3, 0, 16, 0, 0, 1, 64, 0], device="cuda")
    offs = torch.cumsum(rows, 0).to(torch.int32)
    g = torch.randn(G, n_in, n_out, device="cuda", generator=gen)
    w = torch.randn(G, n_in, n_out, device="cuda", generator=gen).to(torch.bfloat16)
    w[rows == 0] = float("nan")
    want = g + w.float() * scale  # fp32 product, then the fp32 add
    want[rows == 0] = g[rows == 0]
    accumulate_groups(g, w, offs, scale)
    if scale in (1.0, 0.5):  # exact products: bitwise
        assert torch.equal(g, want)
    else:  # the GPU may fuse the multiply-add (one rounding instead of two): within 1 fp32 ulp
        ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=torch.finfo(torch.float32).tiny)
        assert bool(((g - want).abs() <= ulp).all()) and torch.equal(g[rows == 0], want[rows == 0])
