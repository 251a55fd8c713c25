"""The expert weight gradient as one grouped GEMM that accumulates straight into the fp32 grad mirror:

    g[grp] += scale * x[rows of grp]^T @ grad[rows of grp]        (beta = 1, fp32 in, fp32 out)

for row groups given by `offs` (cumulative ends, torch._grouped_mm's format). It replaces
torch._grouped_mm's wgrad (which writes a bf16 [G, I, O] temporary on CUDA) plus the masked
accumulation pass (moonep.kernels.experts.accumulate_groups, which reads it back and reads and writes
the fp32 grads): here each program reduces its [BLOCK_I, BLOCK_O] tile over its group's rows in fp32
registers, then loads the grad tile, adds scale * acc and stores it. No bf16 rounding of the product
(the two-pass path rounds it to bf16 before the fp32 add), no temporary.

Groups without rows (unused slots) are skipped: their programs read and write nothing. The first
`write_groups` groups hold stale values (a grad declared zero without clearing it,
ExpertPools.defer_zero_grads): they get scale * x^T grad, zeros when empty, without being read, the
values zero-then-add would give. These are accumulate_groups' semantics (and the DataPath's
accumulate_wgrad signature).

Numerics: the products of bf16 values are exact in fp32; the row sum runs in the tensor cores' order,
then one multiply by scale and one add: within the fp32 bound tests/moonep/helpers/grouped_gemm_cases.py
derives (at most 2 (n + 3) 2^-23 of the summed magnitudes for n rows), not bitwise equal to the PyTorch path,
which on CUDA also rounds the whole product to bf16 (2^-8 relative).

Grid: (tiles of [I, O], G); tiles fastest, so the programs of one group run together and its rows
are read from L2 after the first tile. Rows past offs[-1] are never read.

Tile configs: a short triton.autotune list keyed on (I, O); autotuning restores g between trials
(restore_value: a copy of g, once per key). One small config under TRITON_INTERPRET.
Measured TFLOP/s against torch._grouped_mm + accumulate_groups: benchmarks/bench_expert_gemm.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: small tiles, no tuning
        return [triton.Config({"BLOCK_I": 16, "BLOCK_O": 16, "BLOCK_K": 16})]
    return [triton.Config({"BLOCK_I": i, "BLOCK_O": o, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for i, o, k, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3))]


@triton.autotune(configs=_configs(), key=["I", "O"], restore_value=["g_ptr"])
@triton.jit
def _grouped_wgrad_kernel(g_ptr, x_ptr, d_ptr, offs_ptr, scale, write_n, N, I: tl.constexpr, O: tl.constexpr,
                          BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    num_o = tl.cdiv(O, BLOCK_O)
    end = tl.minimum(tl.load(offs_ptr + grp), N)
    start = tl.minimum(tl.load(offs_ptr + grp - 1, mask=grp > 0, other=0), N)
    write = grp < write_n
    if (end > start) | write:
        ri = (pid // num_o) * BLOCK_I + tl.arange(0, BLOCK_I)
        ro = (pid % num_o) * BLOCK_O + tl.arange(0, BLOCK_O)
        rk = tl.arange(0, BLOCK_K)
        i_ok = ri < I
        o_ok = ro < O
        rows = (start + rk).to(tl.int64)
        x_ptrs = x_ptr + rows[:, None] * I + ri[None, :]
        d_ptrs = d_ptr + rows[:, None] * O + ro[None, :]
        acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            r_ok = (r0 + rk) < end
            xt = tl.load(x_ptrs, mask=r_ok[:, None] & i_ok[None, :], other=0.0)
            dt = tl.load(d_ptrs, mask=r_ok[:, None] & o_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(xt), dt, acc)
            x_ptrs += BLOCK_K * I
            d_ptrs += BLOCK_K * O
        g_ptrs = g_ptr + grp.to(tl.int64) * (I * O) + ri[:, None] * O + ro[None, :]
        mask = i_ok[:, None] & o_ok[None, :]
        if write:
            tl.store(g_ptrs, acc * scale, mask=mask)
        else:
            tl.store(g_ptrs, tl.load(g_ptrs, mask=mask) + acc * scale, mask=mask)


def grouped_wgrad_accumulate(g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor,
                             offs: torch.Tensor, scale: float = 1.0, write_groups: int = 0) -> None:
    """g (fp32 [G, I, O]) += scale * x[rows of g]^T grad[rows of g] in place, for x_rows [N, I] and
    grad_rows [N, O] bf16 and offs int32 [G] (cumulative ends); the first `write_groups` groups are
    written instead (see the module docstring)."""
    if g_GIO.dtype != torch.float32 or g_GIO.dim() != 3 or not g_GIO.is_contiguous():
        raise ValueError(f"grouped_wgrad_accumulate needs a contiguous fp32 grad [G, I, O], got {g_GIO.dtype} "
                         f"{tuple(g_GIO.shape)} contiguous={g_GIO.is_contiguous()}")
    G, I, O = g_GIO.shape
    for name, t, width in (("x_rows", x_rows, I), ("grad_rows", grad_rows, O)):
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != width or not t.is_contiguous() \
                or t.device != g_GIO.device:
            raise ValueError(f"grouped_wgrad_accumulate needs {name} contiguous bf16 [N, {width}] on {g_GIO.device}, "
                             f"got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}")
    if x_rows.shape[0] != grad_rows.shape[0]:
        raise ValueError(f"grouped_wgrad_accumulate needs as many x rows as grad rows, got {x_rows.shape[0]} "
                         f"and {grad_rows.shape[0]}")
    if offs.dtype != torch.int32 or offs.shape != (G,) or offs.device != g_GIO.device:
        raise ValueError(f"grouped_wgrad_accumulate needs offs int32 [G = {G}] on {g_GIO.device} (cumulative group "
                         f"ends), got {offs.dtype} {tuple(offs.shape)} on {offs.device}")
    if not 0 <= write_groups <= G:
        raise ValueError(f"grouped_wgrad_accumulate: write_groups must be in [0, {G}], got {write_groups}")

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(I, meta["BLOCK_I"]) * triton.cdiv(O, meta["BLOCK_O"]), G)

    _grouped_wgrad_kernel[grid](g_GIO, x_rows, grad_rows, offs, float(scale), int(write_groups), x_rows.shape[0],
                                I=I, O=O)
