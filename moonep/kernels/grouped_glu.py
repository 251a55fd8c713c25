"""The expert op's gate and up projections as one grouped GEMM with the gated activation in its epilogue:
for row groups given by `offs` (the format of torch._grouped_mm: cumulative ends of each group's rows)

    h = x W_gate[g]    u = x W_up[g]    a = f(h, u)        on the rows of group g

with W_gate[g] | W_up[g] the two column halves of the merged weight W_gate_up[g] [H, 2F] (moonep.moe) and f a
registered activation (moonep.activation: swiglu, situ_glu). It replaces one torch._grouped_mm of N = 2F and
the activation kernel (moonep.kernels.glu_rows), which write h | u, read them back and write a: here each
program keeps both fp32 accumulators of its [BLOCK_M, BLOCK_N] tile, rounds them to bf16 (round to nearest
even, moonep.kernels.situ_glu.to_bf16) and evaluates f on those rounded values with the activation kernels'
own code (swiglu_value, situ_glu_value).

What the backward needs: h and u, stored from the same epilogue as the halves of one row hu [N, 2F]
(save_preact=True, the default; the elementwise backward reads them, and recomputing them would cost two of
the three forward GEMMs again). With save_preact=False only a is written (a forward without backward).

Numerics: h and u are the fp32-accumulated products rounded once to bf16, as torch._grouped_mm's are,
but summed in another order (not bitwise equal; within the bound tests/moonep/helpers/grouped_gemm_cases.py
derives). a is bitwise equal to the activation kernel applied to the returned h and u: the same
function of the same bf16 values.

Schedule: one program per (row tile, column tile), numbered group by group (a group of r rows has
ceil(r / BLOCK_M) row tiles), within a group column tile by column tile, row tiles fastest: the
programs running together share a group's weight columns (read from HBM about once per group: K3's
gate and up weights are 44 MB per expert, an L2's worth) and its rows (8 MB at K3). The grid is sized
for the worst case (ceil(N / BLOCK_M) + G row tiles: each group adds at most one partial tile) and
programs past the last tile exit, so no host sync is needed to learn the group sizes. A program finds
its tile from one vector load of offs. Rows past offs[-1] (padding no caller reads) are neither read
nor written.

Tile configs: a short triton.autotune list (keyed on H, F), one small config under TRITON_INTERPRET.
Measured TFLOP/s against torch._grouped_mm + the activation kernel: benchmarks/bench_expert_gemm.py.
Rejected: TMA descriptors (a group's rows start anywhere, so per-group device-side descriptors or
masked boxes; pointer loads are what the CPU interpreter can check).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moonep.activation import get_activation
from moonep.kernels.situ_glu import situ_glu_value, to_bf16
from moonep.kernels.swiglu import swiglu_value

ACTIVATION_CODES = {"swiglu": 0, "situ_glu": 1}  # ACT constexpr of the kernel


def _configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: small tiles, no tuning
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})]
    # smem per stage: x [BM, BK] + two weight tiles [BK, BN], bf16 (128/128/64: 48 KiB)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for m, n, k, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4),
                                  (64, 128, 64, 4, 4))]


@triton.jit
def group_tile(offs_ptr, pid, num_n, N, G: tl.constexpr, G_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program pid's tile: (group, first row, end row of the group, column tile). Programs are numbered
    group by group, each group's num_n column tiles in turn, each over the group's ceil(rows / BLOCK_M)
    row tiles. Past the last tile: first row >= end (the caller skips it)."""
    g_G = tl.arange(0, G_P)
    valid = g_G < G
    ends = tl.minimum(tl.load(offs_ptr + g_G, mask=valid, other=0), N)
    starts = tl.minimum(tl.load(offs_ptr + g_G - 1, mask=valid & (g_G > 0), other=0), N)
    tiles = tl.where(valid, (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M, 0)
    progs = tiles * num_n
    grp = tl.sum((tl.cumsum(progs, axis=0) <= pid).to(tl.int32), axis=0)  # groups whose programs all precede pid
    local = pid - tl.sum(tl.where(g_G < grp, progs, 0), axis=0)
    m_tiles = tl.maximum(tl.sum(tl.where(g_G == grp, tiles, 0), axis=0), 1)
    start = tl.sum(tl.where(g_G == grp, starts, 0), axis=0)
    end = tl.sum(tl.where(g_G == grp, ends, 0), axis=0)
    return grp, start + (local % m_tiles) * BLOCK_M, end, local // m_tiles


@triton.autotune(configs=_configs(), key=["H", "F"])
@triton.jit
def _grouped_glu_kernel(x_ptr, w_ptr, offs_ptr, a_ptr, hu_ptr, N, H: tl.constexpr, F: tl.constexpr,
                        G: tl.constexpr, G_P: tl.constexpr, ACT: tl.constexpr, SAVE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    grp, row0, end, n_idx = group_tile(offs_ptr, tl.program_id(0), tl.cdiv(F, BLOCK_N), N, G, G_P, BLOCK_M)
    if row0 < end:
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = n_idx * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < end
        col_ok = rn < F
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * H + rk[None, :]
        wg_ptrs = w_ptr + grp.to(tl.int64) * (H * 2 * F) + rk[:, None] * (2 * F) + rn[None, :]  # gate: columns [0, F)
        wu_ptrs = wg_ptrs + F  # up: columns [F, 2F) of the same rows
        acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = (k0 + rk) < H
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc_h = tl.dot(xt, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_h)
            acc_u = tl.dot(xt, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K * 2 * F
            wu_ptrs += BLOCK_K * 2 * F
        h = to_bf16(acc_h)
        u = to_bf16(acc_u)
        if ACT == 0:
            a = swiglu_value(h.to(tl.float32), u.to(tl.float32), tl.bfloat16)
        else:
            a = situ_glu_value(h.to(tl.float32), u.to(tl.float32))
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(a_ptr + rm[:, None].to(tl.int64) * F + rn[None, :], a, mask=mask)
        if SAVE:
            out = rm[:, None].to(tl.int64) * (2 * F) + rn[None, :]
            tl.store(hu_ptr + out, h, mask=mask)
            tl.store(hu_ptr + out + F, u, mask=mask)


def _check(x_rows: torch.Tensor, w_gate_up: torch.Tensor, offs: torch.Tensor) -> None:
    for name, t in {"x_rows": x_rows, "w_gate_up": w_gate_up}.items():
        if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device != x_rows.device:
            raise ValueError(f"grouped_glu_forward needs contiguous bf16 tensors on one device, got {name} "
                             f"{t.dtype} contiguous={t.is_contiguous()} on {t.device}")
    if (x_rows.dim() != 2 or w_gate_up.dim() != 3 or w_gate_up.shape[1] != x_rows.shape[1]
            or w_gate_up.shape[2] % 2):
        raise ValueError(f"grouped_glu_forward needs x_rows [N, H] and w_gate_up [G, H, 2F], got "
                         f"{tuple(x_rows.shape)}, {tuple(w_gate_up.shape)}")
    if offs.dtype != torch.int32 or offs.shape != (w_gate_up.shape[0],) or offs.device != x_rows.device:
        raise ValueError(f"grouped_glu_forward needs offs int32 [G = {w_gate_up.shape[0]}] on {x_rows.device} "
                         f"(cumulative group ends), got {offs.dtype} {tuple(offs.shape)} on {offs.device}")


def grouped_glu_forward(x_rows: torch.Tensor, w_gate_up: torch.Tensor, offs: torch.Tensor,
                        activation: str = "swiglu", save_preact: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a [N, F], hu [N, 2F]) bf16 for the row groups of `offs` (see the module docstring), hu = h | u the two
    halves of one row; hu is None when save_preact is False. Rows past offs[-1] of the outputs are left
    unwritten."""
    get_activation(activation)  # ValueError naming the registered ones
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"grouped_glu_forward has no epilogue for activation {activation!r}; it fuses "
                         f"{sorted(ACTIVATION_CODES)}")
    _check(x_rows, w_gate_up, offs)
    N, H = x_rows.shape
    G, _, F2 = w_gate_up.shape
    F = F2 // 2
    a = torch.empty(N, F, device=x_rows.device, dtype=torch.bfloat16)
    hu = torch.empty(N, F2, device=x_rows.device, dtype=torch.bfloat16) if save_preact else None
    if N == 0:
        return a, hu

    def grid(meta: dict) -> tuple[int]:
        return ((triton.cdiv(N, meta["BLOCK_M"]) + G) * triton.cdiv(F, meta["BLOCK_N"]),)

    _grouped_glu_kernel[grid](x_rows, w_gate_up, offs, a, a if hu is None else hu, N, H=H, F=F, G=G,
                              G_P=triton.next_power_of_2(G), ACT=ACTIVATION_CODES[activation], SAVE=save_preact)
    return a, hu
