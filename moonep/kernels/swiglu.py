"""Triton kernels of the "swiglu" activation of expert_glu, forward and backward (moonep.activation
is the specification).

Forward: a = bf16(silu(h)) * u in one pass (F.silu(h) * u is two: silu writes a temporary that the
multiply reads back; ~0.45 ms per k3_small_moe layer and pass on an H200, this ~0.27 ms of HBM).

Backward (`swiglu_grads`, the elementwise part of moonep.kernels.glu_route's one-pass kernel): from
grad_a = dL/da for a = silu(h) * u, in fp32 and in the PyTorch path's operation order,
    grad_h = grad_a * u * sig * (1 + h * (1 - sig))    sig = sigmoid(h)
    grad_u = grad_a * h * sig
    a      = bf16(silu(h)) * u                         recomputed as F.silu(h) * u does (silu rounded first)
each rounded once by the caller. Values agree with the eager path to an ulp or so of bf16 (the device's
exp differs from torch.sigmoid's), which tests/moonep/kernels/test_expert_math_*.py bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep.kernels.glu_launch import launch_forward
from moonep.kernels.situ_glu import to_bf16


@triton.jit
def swiglu_value(hf, uf, dtype: tl.constexpr):
    """a = silu(h) * u in `dtype` from fp32 h, u (silu rounded to `dtype` first, as F.silu(h) * u does);
    also the epilogue of moonep.kernels.grouped_glu."""
    silu = hf / (1.0 + tl.exp(-hf))
    return (silu.to(dtype).to(tl.float32) * uf).to(dtype)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, u_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    hf = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
    uf = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(a_ptr + offs, swiglu_value(hf, uf, a_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_grads(ga, hf, uf):
    """(grad_h, grad_u, a) in fp32 from fp32 grad_a, h, u, in the PyTorch path's operation order; a is
    bf16(silu(h)) * u before its final rounding (moonep.kernels.glu_route rounds all three). silu is
    rounded on the bits, as torch rounds (Triton's interpreter truncates a cast)."""
    sig = 1.0 / (1.0 + tl.exp(-hf))
    silu = hf * sig
    grad_h = ga * uf * sig * (1.0 + hf * (1.0 - sig))
    grad_u = ga * silu
    return grad_h, grad_u, to_bf16(silu).to(tl.float32) * uf


def swiglu_forward(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """a = silu(h) * u in h's dtype, silu rounded first as F.silu(h) * u does."""
    return launch_forward(_swiglu_fwd_kernel, "swiglu_forward", h, u)

