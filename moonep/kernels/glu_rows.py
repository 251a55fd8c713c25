"""Triton kernel of expert_glu's gated activation on the merged gate|up GEMM's output: a = f(h, u) with h and u
the two halves of each row of hu [rows, 2F] (moonep.moe), read in place (no copy of either half).

Each program takes BLOCK_R rows and walks F in BLOCK_F chunks (the tiles of moonep.kernels.glu_route's
backward, glu_route.backward_tiles); the values are the activation kernels' own (swiglu_value, situ_glu_value:
moonep.kernels.swiglu / .situ_glu), so a is bitwise what those kernels give for the same h and u.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep.kernels.glu_route import ACTIVATION_IDS, backward_tiles
from moonep.kernels.situ_glu import situ_glu_value
from moonep.kernels.swiglu import swiglu_value


@triton.jit
def _glu_rows_fwd_kernel(hu_ptr, a_ptr, n_rows, F, ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = r < n_rows
    for f0 in range(0, F, BLOCK_F):
        ff = f0 + tl.arange(0, BLOCK_F)
        m = r_ok[:, None] & (ff < F)[None, :]
        at_h = r[:, None] * (2 * F) + ff[None, :]
        hf = tl.load(hu_ptr + at_h, mask=m, other=0.0).to(tl.float32)
        uf = tl.load(hu_ptr + at_h + F, mask=m, other=0.0).to(tl.float32)
        if ACT == 0:
            a = swiglu_value(hf, uf, a_ptr.dtype.element_ty)
        else:
            a = situ_glu_value(hf, uf)
        tl.store(a_ptr + r[:, None] * F + ff[None, :], a, mask=m)


def glu_forward_rows(activation: str, hu: torch.Tensor) -> torch.Tensor:
    """a [rows, F] = f(hu[:, :F], hu[:, F:]) in hu's dtype (situ_glu: bf16 only, as its kernel)."""
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"glu_forward_rows has no kernel for activation {activation!r}; it has {sorted(ACTIVATION_IDS)}")
    if hu.dim() != 2 or hu.shape[1] % 2 or not hu.is_contiguous():
        raise ValueError(f"glu_forward_rows needs a contiguous hu [rows, 2F], got {tuple(hu.shape)} "
                         f"contiguous={hu.is_contiguous()}")
    if activation == "situ_glu" and hu.dtype != torch.bfloat16:
        raise ValueError(f"glu_forward_rows: the situ_glu kernel writes bf16, got hu in {hu.dtype}")
    n, F = hu.shape[0], hu.shape[1] // 2
    a = torch.empty(n, F, dtype=hu.dtype, device=hu.device)
    block_r, block_f, warps = backward_tiles(F)
    _glu_rows_fwd_kernel[(triton.cdiv(n, block_r),)](hu, a, n, F, ACT=ACTIVATION_IDS[activation], BLOCK_R=block_r,
                                                     BLOCK_F=block_f, num_warps=warps)
    return a
