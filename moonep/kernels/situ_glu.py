"""Triton kernels of SiTU-GLU, forward and the one-pass elementwise backward (moonep.activation holds the
specification: same formulas, same operation order, one rounding per output).

Forward: a = situ(h) * cap(u), read h and u (bf16), write a (bf16).
Backward: from grad_a, h, u (bf16) write grad_h, grad_u and the recomputed a (bf16) in one pass, the
elementwise part of the expert backward (the eager form makes ~20 fp32 passes over [N, F]).

Rounding fp32 -> bf16 is done on the bits (round to nearest, ties to even; finite values) rather than
by a cast, because Triton's interpreter casts by truncating: written this way the interpreter and the
GPU round as torch does, so under TRITON_INTERPRET=1 the outputs equal the specification's bit for bit
once both use the same exp (tests/moonep/kernels/test_expert_math_interpreted.py). On the GPU, exp and fp32
division are the device's (approximate) instructions: within one bf16 ulp of the specification
(tests/moonep/kernels/test_expert_math_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep.kernels.glu_launch import launch_backward, launch_forward


@triton.jit
def _tanh_sech2(x):
    """moonep.activation._tanh_sech2, operation for operation."""
    x2 = x * x
    poly = x + x * (x2 * (x2 * (2.0 / 15.0) - (1.0 / 3.0)))
    e = tl.exp(-2.0 * tl.abs(x))
    big = (1.0 - e) / (1.0 + e)
    small = tl.abs(x) < 0.0625
    t = tl.where(small, poly, tl.where(x < 0, -big, big))
    sech2 = tl.where(small, 1.0 - poly * poly, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    return t, sech2


@triton.jit
def _sigmoid_dsigmoid(x):
    """moonep.activation._sigmoid_dsigmoid, operation for operation."""
    e = tl.exp(-tl.abs(x))
    inv = 1.0 / (1.0 + e)
    return tl.where(x < 0, e * inv, inv), e * (inv * inv)


@triton.jit
def to_bf16(x):
    """fp32 -> bf16 bits, round to nearest even (what torch's .to(bfloat16) does for finite values)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def situ_glu_value(hf, uf):
    """a = situ(h) * cap(u) in bf16 from fp32 h, u; also the epilogue of moonep.kernels.grouped_glu."""
    t, _ = _tanh_sech2(hf / 4.0)
    sig, _ = _sigmoid_dsigmoid(hf)
    c, _ = _tanh_sech2(uf / 25.0)
    return to_bf16((4.0 * t * sig) * (25.0 * c))


@triton.jit
def _situ_glu_fwd_kernel(h_ptr, u_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    hf = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
    uf = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(a_ptr + offs, situ_glu_value(hf, uf), mask=m)


@triton.jit
def situ_glu_grads(ga, hf, uf):
    """(grad_h, grad_u, a) in fp32 from fp32 grad_a, h, u (moonep.activation.situ_glu_backward's order);
    rounded by the caller (here and in moonep.kernels.glu_route)."""
    t, sech2_t = _tanh_sech2(hf / 4.0)
    sig, dsig = _sigmoid_dsigmoid(hf)
    c, sech2_c = _tanh_sech2(uf / 25.0)
    situ = 4.0 * t * sig
    cap = 25.0 * c
    dsitu = sech2_t * sig + 4.0 * t * dsig
    return ga * cap * dsitu, ga * situ * sech2_c, situ * cap


@triton.jit
def _situ_glu_bwd_kernel(ga_ptr, h_ptr, u_ptr, gh_ptr, gu_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ga = tl.load(ga_ptr + offs, mask=m, other=0.0).to(tl.float32)
    hf = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
    uf = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    grad_h, grad_u, a = situ_glu_grads(ga, hf, uf)
    tl.store(gh_ptr + offs, to_bf16(grad_h), mask=m)
    tl.store(gu_ptr + offs, to_bf16(grad_u), mask=m)
    tl.store(a_ptr + offs, to_bf16(a), mask=m)


def situ_glu_forward(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """a = situ(h) * cap(u) (bf16); see moonep.activation.situ_glu_forward."""
    return launch_forward(_situ_glu_fwd_kernel, "situ_glu_forward", h, u, dtype=torch.bfloat16)


def situ_glu_backward(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) (bf16); see moonep.activation.situ_glu_backward."""
    return launch_backward(_situ_glu_bwd_kernel, "situ_glu_backward", grad_a, h, u, dtype=torch.bfloat16)
