"""moontrain.model.attn_res_kernel on one GPU at k3_small's shape ([4, 4096, 2048] bf16, N = 1..4 values):
h and every gradient against the specification (attn_res.depth_forward / depth_backward) in float64 on the
same values. Bounds as tests/moontrain/model/test_attn_res_kernel_interpreted.py derives them, with the GPU's
round-to-nearest bf16 cast (2^-8 relative) for the bf16 outputs; the query's grad sums over all M rows."""

from __future__ import annotations

import pytest
import torch

from moontrain.model import attn_res

pytestmark = pytest.mark.gpu

B, T, D = 4, 4096, 2048
U32 = 2.0**-24


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    diff = (got.double() - want.double()).abs().max().item()
    tol = rel * max(want.abs().max().item(), 1.0)
    assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("N", [1, 2, 4])
def test_kernels_match_spec_at_k3_small_shape(N: int) -> None:
    # imported here: collected on the CPU before a *_interpreted module sets TRITON_INTERPRET, a module-level
    # import would decorate the kernels for the GPU driver
    from moontrain.model import attn_res_kernel

    gen = torch.Generator(device="cuda").manual_seed(N)
    values = tuple((torch.randn(B, T, D, device="cuda", generator=gen) * (1 + 0.5 * i)).to(torch.bfloat16)
                   for i in range(N))
    query = 0.05 * torch.randn(D, device="cuda", generator=gen)
    key_weight = 1 + 0.1 * torch.randn(D, device="cuda", generator=gen)
    grad_h = torch.randn(B, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    h, r, p = attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    gq, gw, gv = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values)
    v64 = tuple(v.double() for v in values)
    h64, r64, p64 = attn_res.depth_forward(query.double(), key_weight.double(), 1e-6, v64)
    gq64, gw64, gv64 = attn_res.depth_backward(query.double(), key_weight.double(), r64, p64, grad_h.double(), v64)
    M = B * T
    rel = 16 * (D + N) * U32 + 2.0**-8
    _close("h", h, h64, rel)
    _close("p", p, p64, 16 * (D + N) * U32)
    _close("grad query", gq, gq64, 16 * (D + N + M) * U32)
    _close("grad key weight", gw, gw64, 16 * (D + N + M) * U32)
    for i, (a, b) in enumerate(zip(gv, gv64, strict=True)):
        _close(f"grad value {i}", a, b, rel)


def test_backward_sums_into_block_gradients_at_k3_small_shape() -> None:
    """Three completed blocks' gradient sums (attn_res.BlockGrad) and the partial sum's fresh gradient, N = 4:
    each sum gains the value's gradient in fp32 before one round-to-nearest bf16 rounding."""
    from moontrain.model import attn_res_kernel

    N = 4
    gen = torch.Generator(device="cuda").manual_seed(9)
    values = tuple((torch.randn(B, T, D, device="cuda", generator=gen) * (1 + 0.5 * i)).to(torch.bfloat16)
                   for i in range(N))
    query = 0.05 * torch.randn(D, device="cuda", generator=gen)
    key_weight = 1 + 0.1 * torch.randn(D, device="cuda", generator=gen)
    grad_h = torch.randn(B, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    into = [torch.randn(B, T, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(N - 1)] + [None]
    before = [t.double() for t in into[:-1]]
    _, r, p = attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    _, _, gv = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values, into)
    v64 = tuple(v.double() for v in values)
    _, r64, p64 = attn_res.depth_forward(query.double(), key_weight.double(), 1e-6, v64)
    gv64 = attn_res.depth_backward(query.double(), key_weight.double(), r64, p64, grad_h.double(), v64)[2]
    rel = 16 * (D + N) * U32 + 2.0**-8
    for i in range(N):
        assert (gv[i] is into[i]) == (i < N - 1)
        _close(f"grad value {i}", gv[i], gv64[i] + (before[i] if i < N - 1 else 0), rel)


def test_parameter_grads_in_bf16_and_repeatable_at_k3_small_shape() -> None:
    """bf16 parameters (the compute copies of parallel.dense=plain): the 4,096 row blocks walked by at most
    BWD_PROGRAMS programs, their dq partials summed by _param_grad_kernel; each parameter's gradient within the
    fp32 bound plus one round-to-nearest bf16 rounding, and a second call bitwise the first (a fixed order)."""
    from moontrain.model import attn_res_kernel

    N = 3
    gen = torch.Generator(device="cuda").manual_seed(21)
    values = tuple((torch.randn(B, T, D, device="cuda", generator=gen) * (1 + 0.5 * i)).to(torch.bfloat16)
                   for i in range(N))
    query = (0.05 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
    key_weight = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
    grad_h = torch.randn(B, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    _, r, p = attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    gq, gw, _ = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values)
    gq2, gw2, _ = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values)
    assert gq.dtype == gw.dtype == torch.bfloat16
    assert torch.equal(gq, gq2) and torch.equal(gw, gw2)
    v64 = tuple(v.double() for v in values)
    _, r64, p64 = attn_res.depth_forward(query.double(), key_weight.double(), 1e-6, v64)
    gq64, gw64, _ = attn_res.depth_backward(query.double(), key_weight.double(), r64, p64, grad_h.double(), v64)
    rel = 16 * (D + N + B * T) * U32 + 2.0**-8
    _close("grad query", gq, gq64, rel)
    _close("grad key weight", gw, gw64, rel)
