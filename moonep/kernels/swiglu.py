"""Triton kernels of the "swiglu" activation of expert_glu, forward and backward (moonep.activation
is the specification).

Forward: a = bf16(silu(h)) * u in one pass (F.silu(h) * u is two: silu writes a temporary that the
multiply reads back; ~0.45 ms per k3_small_moe layer and pass on an H200, this ~0.27 ms of HBM).

Given grad_a = dL/da for a = silu(h) * u (bf16 [N, F]), one pass computes
    grad_h = grad_a * u * sig * (1 + h * (1 - sig))    sig = sigmoid(h), fp32, rounded once to bf16
    grad_u = grad_a * h * sig                          fp32, rounded once to bf16
    a      = bf16(silu(h)) * u                         recomputed as F.silu(h) * u does (silu rounded first)
with the PyTorch path's operation order. The eager version makes ~12 fp32 passes over [N, F]
(k3_small_moe: N ~ 68k rows, F = 1024, ~280 MB per fp32 pass); this reads three bf16 tensors and
writes three. Values agree with the eager path to an ulp or so of bf16 (the device's exp differs from
torch.sigmoid's), which tests/moonep/kernels/test_expert_math_interpreted.py and the GPU tests bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep.kernels.glu_launch import launch_backward, launch_forward


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
def _swiglu_bwd_kernel(ga_ptr, h_ptr, u_ptr, gh_ptr, gu_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ga = tl.load(ga_ptr + offs, mask=m, other=0.0).to(tl.float32)
    hf = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
    uf = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-hf))
    silu = hf * sig
    grad_h = ga * uf * sig * (1.0 + hf * (1.0 - sig))
    grad_u = ga * silu
    a = silu.to(a_ptr.dtype.element_ty).to(tl.float32) * uf
    tl.store(gh_ptr + offs, grad_h.to(gh_ptr.dtype.element_ty), mask=m)
    tl.store(gu_ptr + offs, grad_u.to(gu_ptr.dtype.element_ty), mask=m)
    tl.store(a_ptr + offs, a.to(a_ptr.dtype.element_ty), mask=m)


def swiglu_forward(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """a = silu(h) * u in h's dtype, silu rounded first as F.silu(h) * u does."""
    return launch_forward(_swiglu_fwd_kernel, "swiglu_forward", h, u)


def swiglu_backward(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) in h's dtype; see the module docstring."""
    return launch_backward(_swiglu_bwd_kernel, "swiglu_backward", grad_a, h, u)
