"""Triton kernel for the route weights in expert_glu's forward (moonep.datapath.reference is the
specification; backward folds the weights into moonep.kernels.glu_route):

forward   y_rows[r] = bf16(o[r] * w[r])                   (fp32 product, one rounding)

Why kernels: the eager `torch.mul(o_bf16, w_fp32[:, None], out=bf16)` mixes dtypes with a broadcast
and runs TensorIterator's generic (not vectorised) loop: 603 us per call at k3_small_moe's
[68416, 2048] on H200 where the bytes take ~170 us (bench_train profile, 2026-11-30), 14 calls per
step. The product is exact in fp32 (bf16 x fp32 rounded once as torch does), so y_rows equals the
eager result bitwise (on the GPU; Triton's interpreter truncates the cast: within one bf16 ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_R, _BLOCK_H, _WARPS = 4, 1024, 4


@triton.jit
def _scale_rows_kernel(x_ptr, w_ptr, out_ptr, n_rows, H, x_stride, out_stride,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = r < n_rows
    w = tl.load(w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        m = r_ok[:, None] & (hh < H)[None, :]
        x = tl.load(x_ptr + r[:, None] * x_stride + hh[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r[:, None] * out_stride + hh[None, :], (x * w[:, None]).to(out_ptr.dtype.element_ty), mask=m)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [{', '.join(map(str, shape))}] with unit stride along the last dim, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


def scale_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = (x[r] * w[r]) in fp32, rounded once to out's dtype (torch.mul(x, w[:, None], out=out))."""
    n, H = x.shape
    _check_rows("x", x, (n, H))
    _check_rows("out", out, (n, H))
    _check_rows("w", w, (n,))
    _scale_rows_kernel[(triton.cdiv(n, _BLOCK_R),)](x, w, out, n, H, x.stride(0), out.stride(0),
                                                    BLOCK_R=_BLOCK_R, BLOCK_H=_BLOCK_H, num_warps=_WARPS)
    return out

