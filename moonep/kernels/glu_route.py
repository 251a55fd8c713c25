"""Triton kernel of expert_glu's elementwise backward with the route weights folded in (one pass; the
specification is moonep.datapath.reference.glu_route_backward).

For one row r of the expert output o = a W_down, weighted y = w o (w the row's route weight), backward
starts from g = gy W_down^T, the dispatched output grad times the down projection (no weight applied),
and needs neither o nor gy again:

    grad_a = w * g                        (fp32)
    grad_h, grad_u, a                     the activation's backward of grad_a (moonep.kernels.swiglu /
                                          situ_glu: the same fp32 formulas), each rounded once to bf16
    grad_w = sum_f g[f] * a[f]            (fp32; = sum_h gy[h] o[h], since o = a W_down)
    a_w    = bf16(w * a)                  the down projection's weight-gradient input: dW_down = a_w^T gy

So the op saves h and u only (not o [rows, H]), and the route-weight pass over gy and o (read two
[rows, H] tensors, write grad_o) is gone: this kernel reads g, h, u and writes grad_h, grad_u, a_w,
all [rows, F]. glu_route_backward_rows takes h and u as the two halves of one row (expert_glu's merged gate|up
GEMM output, [rows, 2F]) and writes grad_h | grad_u the same way; glu_route_backward takes and returns them as
separate tensors (the dense FFNs' backward, moonep.activation.glu_backward).

Each program takes BLOCK_R rows and walks F in BLOCK_F chunks, summing grad_w per chunk then across
chunks in a fixed order (deterministic; another order than torch.sum's, within the bound the tests
derive). The tiles depend on F only (backward_tiles): for F <= 1024, 4 rows x 128 where 128 divides F (the
routed experts of k3_small, F = 896: no masked lanes; on an H100 the backward 621 -> 552 us and the rows' forward
310 -> 284 us against one masked 1024-wide chunk), else 2 rows x 1024 (one chunk); above, 4 rows x 256 (k3_small's
shared experts and dense FFN, where 128-wide chunks were 4-5 % slower): the best of the tiles
benchmarks/bench_glu_route.py sweeps at k3_small's shapes (docs/performance.md). Rounding to bf16 is done on the bits
(moonep.kernels.situ_glu.to_bf16) so that Triton's interpreter rounds as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep.kernels.glu_launch import check_glu_inputs
from moonep.kernels.situ_glu import situ_glu_grads, to_bf16
from moonep.kernels.swiglu import swiglu_grads

ACTIVATION_IDS = {"swiglu": 0, "situ_glu": 1}


def backward_tiles(F: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, warps) of the backward kernel for rows of F (module docstring)."""
    if F > 1024:
        return 4, 256, 4
    return (4, 128, 4) if F % 128 == 0 else (2, 1024, 4)


@triton.jit
def _glu_route_bwd_kernel(g_ptr, h_ptr, u_ptr, w_ptr, gh_ptr, gu_ptr, aw_ptr, gw_ptr, n_rows, F, stride_hu, stride_ghu,
                          ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = r < n_rows
    w = tl.load(w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        ff = f0 + tl.arange(0, BLOCK_F)
        m = r_ok[:, None] & (ff < F)[None, :]
        offs = r[:, None] * F + ff[None, :]
        at_hu = r[:, None] * stride_hu + ff[None, :]
        at_ghu = r[:, None] * stride_ghu + ff[None, :]
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        hf = tl.load(h_ptr + at_hu, mask=m, other=0.0).to(tl.float32)
        uf = tl.load(u_ptr + at_hu, mask=m, other=0.0).to(tl.float32)
        ga = g * w[:, None]
        if ACT == 0:
            grad_h, grad_u, a = swiglu_grads(ga, hf, uf)
        else:
            grad_h, grad_u, a = situ_glu_grads(ga, hf, uf)
        a16 = to_bf16(a)
        tl.store(gh_ptr + at_ghu, to_bf16(grad_h), mask=m)
        tl.store(gu_ptr + at_ghu, to_bf16(grad_u), mask=m)
        af = a16.to(tl.float32)
        tl.store(aw_ptr + offs, to_bf16(af * w[:, None]), mask=m)
        acc += tl.sum(g * af, axis=1)
    tl.store(gw_ptr + r, acc, mask=r_ok)


def _check(activation: str, n: int, w_rows: torch.Tensor) -> None:
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"glu_route_backward has no kernel for activation {activation!r}; "
                         f"it has {sorted(ACTIVATION_IDS)}")
    if w_rows.shape != (n,) or w_rows.dtype != torch.float32 or not w_rows.is_contiguous():
        raise ValueError(f"glu_route_backward needs contiguous fp32 route weights [{n}], got "
                         f"{tuple(w_rows.shape)} {w_rows.dtype}")


def _launch(activation: str, g: torch.Tensor, h: torch.Tensor, u: torch.Tensor, w_rows: torch.Tensor,
            grad_h: torch.Tensor, grad_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_w, grad_w); h and u share a row stride, as grad_h and grad_u do (the halves of one row or two tensors)."""
    n, F = g.shape
    a_w = torch.empty_like(g)
    grad_w = torch.empty(n, dtype=torch.float32, device=g.device)
    block_r, block_f, warps = backward_tiles(F)
    _glu_route_bwd_kernel[(triton.cdiv(n, block_r),)](
        g, h, u, w_rows, grad_h, grad_u, a_w, grad_w, n, F, h.stride(0), grad_h.stride(0),
        ACT=ACTIVATION_IDS[activation], BLOCK_R=block_r, BLOCK_F=block_f, num_warps=warps)
    return a_w, grad_w


def glu_route_backward(activation: str, g: torch.Tensor, h: torch.Tensor, u: torch.Tensor, w_rows: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a_w, grad_w): bf16 [rows, F] x3 and fp32 [rows]; see the module docstring."""
    check_glu_inputs("glu_route_backward", g, h, u, dtype=torch.bfloat16)
    _check(activation, h.shape[0], w_rows)
    grad_h, grad_u = torch.empty_like(h), torch.empty_like(h)
    a_w, grad_w = _launch(activation, g, h, u, w_rows, grad_h, grad_u)
    return grad_h, grad_u, a_w, grad_w


def glu_route_backward_rows(activation: str, g: torch.Tensor, hu: torch.Tensor, w_rows: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hu, a_w, grad_w) from hu [rows, 2F] = h | u: grad_hu = grad_h | grad_u bf16 [rows, 2F] (the input
    of the merged gate|up GEMMs' backward), a_w bf16 [rows, F], grad_w fp32 [rows]; the same values as
    glu_route_backward's."""
    n, F2 = hu.shape
    F = F2 // 2
    ok = (hu.dtype == g.dtype == torch.bfloat16 and hu.is_contiguous() and g.is_contiguous() and F2 % 2 == 0
          and tuple(g.shape) == (n, F))
    if not ok:
        raise ValueError(f"glu_route_backward_rows needs contiguous bf16 g [rows, F] and hu [rows, 2F], got "
                         f"{tuple(g.shape)} {g.dtype} and {tuple(hu.shape)} {hu.dtype}")
    _check(activation, n, w_rows)
    grad_hu = torch.empty_like(hu)
    a_w, grad_w = _launch(activation, g, hu[:, :F], hu[:, F:], w_rows, grad_hu[:, :F], grad_hu[:, F:])
    return grad_hu, a_w, grad_w
