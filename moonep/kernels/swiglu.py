"""The "swiglu" activation of expert_glu as Triton functions, forward value and backward (moonep.activation
is the specification); the kernels that call them: moonep.kernels.glu_rows (forward), .glu_route (backward),
.grouped_glu (the fused GEMM's epilogue).

Forward (`swiglu_value`): a = bf16(silu(h)) * u in one pass (F.silu(h) * u is two: silu writes a temporary
that the multiply reads back).

Backward (`swiglu_grads`, the elementwise part of moonep.kernels.glu_route's one-pass kernel): from
grad_a = dL/da for a = silu(h) * u, in fp32 and in the PyTorch path's operation order,
    grad_h = grad_a * u * sig * (1 + h * (1 - sig))    sig = sigmoid(h)
    grad_u = grad_a * h * sig
    a      = bf16(silu(h)) * u                         recomputed as F.silu(h) * u does (silu rounded first)
each rounded once by the caller. Values agree with the eager path to an ulp or so of bf16 (the device's
exp differs from torch.sigmoid's), which tests/moonep/kernels/test_expert_math_*.py bound.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moonep.kernels.situ_glu import to_bf16


@triton.jit
def swiglu_value(hf, uf, dtype: tl.constexpr):
    """a = silu(h) * u in `dtype` from fp32 h, u (silu rounded to `dtype` first, as F.silu(h) * u does);
    also the epilogue of moonep.kernels.grouped_glu."""
    silu = hf / (1.0 + tl.exp(-hf))
    return (silu.to(dtype).to(tl.float32) * uf).to(dtype)


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

