"""Triton kernels for the expert-weight side: prefetch_weight, reduce_grad and the masked
weight-gradient accumulation, bitwise equal to moonep.datapath.reference (the specification).

The PyTorch path is sync-free, so it cannot know which slots are occupied: prefetch
copies all B slots (empty ones onto themselves) and reduce_grad reads every slot of every peer,
masked. Measured on 2xH200 (2026-11-29, E=96, R=2, one expert copy of 88 MB): prefetch 4.7 ms,
reduce_grad 17.7 ms. These kernels read the slot table on the device and skip empty slots, so the
traffic is the expert copies themselves.

Grids: one program per chunk of BLOCK elements of an expert row, looping over the slots (groups)
in use in ascending order: one vector load of the slot table (offs), a running count, and per step
a vector select of the k-th used entry. A (chunks x B) grid of mostly-empty programs cost ~1 ms
at K3 shapes (prefetch 1.47 ms for one 88 MB copy at E=384, 2xH200, 2026-11-29).
prefetch: program c copies chunk c of W_full[e] (the owner's row, read over NVLink) into
    W_full[E + j] for every used slot j of this rank. Stream order after dispatch's barriers makes
    the owners' rows current.
accumulate_groups: the expert_glu backward's weight gradient (bf16 from the grouped GEMM) added
    into the fp32 grad mirror (W_compact rows) for groups with rows only; on k3_small_moe at low
    skew half of the groups are empty slots. The local rows of a layer whose grads were declared
    zero without clearing (ExpertPools.defer_zero_grads) are written instead of added: 6 bytes per
    element instead of 10 in the step's first pass, and no separate zeroing pass.
reduce_grad: program c adds, for d = 0..R-1 ascending (d != rank) and each used slot j of d
    ascending, chunk c of slot (d, j) into g_local[i] when it holds this rank's expert rank*epn + i,
    in fp32, one add per contribution: the PyTorch path's order (a rank holds at most one copy of
    an expert), hence the same values (the PyTorch path also adds +0.0 for empty slots, which can
    only turn a -0.0 into +0.0). Experts without copies are never touched. Then, after the
    "reduce_grad:read" barrier, `zero_slots` clears this rank's used slots (the others were never
    written: grads of empty groups are zero).

Checked bitwise against the PyTorch path in Triton's interpreter on the CPU heap (R = 2, 4) and on
2xH200 (tests/moonep/kernels/test_experts_multigpu.py, 2026-11-29). Measured there with
benchmarks/bench_comm.py (H=7168, F=2048, one expert copy of 88 MB, E=96 and 384, maxvio 0-20):
prefetch 272-290 us and reduce_grad 588-601 us, against 1471-1473 us and 3022-3059 us for
(chunks x slots) grids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _kth(pick_B, order_B, j_B, vals_B, k):
    """(index, value) of the k-th True of pick_B (order_B: its running count minus one)."""
    hit = pick_B & (order_B == k)
    return tl.sum(tl.where(hit, j_B, 0), axis=0).to(tl.int64), tl.sum(tl.where(hit, vals_B, 0), axis=0).to(tl.int64)


@triton.jit
def _used_slots(slot_ptr, rank, B: tl.constexpr, B_P: tl.constexpr):
    """Rank `rank`'s slot table: (slot index, expert or -1, used, running count of used - 1)."""
    j_B = tl.arange(0, B_P)
    slots = tl.load(slot_ptr + rank * B + j_B, mask=j_B < B, other=-1)
    used = slots >= 0
    return j_B, slots, used, tl.cumsum(used.to(tl.int32), axis=0) - 1


@triton.jit
def _prefetch_kernel(w_ptr, slot_ptr, rank, ROW: tl.constexpr, E: tl.constexpr, B: tl.constexpr,
                     B_P: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # offsets pass 2**31 at K3 sizes
    mask = offs < ROW
    j_B, slots, used, order = _used_slots(slot_ptr, rank, B, B_P)
    for k in range(0, tl.sum(used.to(tl.int32), axis=0)):
        j, e = _kth(used, order, j_B, slots, k)
        tl.store(w_ptr + (E + j) * ROW + offs, tl.load(w_ptr + e * ROW + offs, mask=mask), mask=mask)


@triton.jit
def _reduce_kernel(g_local_ptr, g_slots_ptr, slot_ptr, rank, ROW: tl.constexpr, R: tl.constexpr, B: tl.constexpr,
                   B_P: tl.constexpr, EPN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    j_B = tl.arange(0, B_P)
    for d in tl.static_range(R):  # ascending d, then ascending slot: the PyTorch path's order
        if d != rank:
            slots = tl.load(slot_ptr + d * B + j_B, mask=j_B < B, other=-1)
            mine = (slots >= rank * EPN) & (slots < (rank + 1) * EPN)
            order = tl.cumsum(mine.to(tl.int32), axis=0) - 1
            for k in range(0, tl.sum(mine.to(tl.int32), axis=0)):
                j, e = _kth(mine, order, j_B, slots, k)
                g_row = g_local_ptr + (e - rank * EPN) * ROW + offs
                slot_row = g_slots_ptr + (d * B + j) * ROW + offs
                tl.store(g_row, tl.load(g_row, mask=mask) + tl.load(slot_row, mask=mask), mask=mask)


@triton.jit
def _zero_kernel(g_slots_ptr, slot_ptr, rank, ROW: tl.constexpr, B: tl.constexpr, B_P: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    j_B, slots, used, order = _used_slots(slot_ptr, rank, B, B_P)
    for k in range(0, tl.sum(used.to(tl.int32), axis=0)):
        j, _ = _kth(used, order, j_B, slots, k)
        tl.store(g_slots_ptr + (rank * B + j) * ROW + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


@triton.jit
def _accumulate_kernel(g_ptr, w_ptr, offs_ptr, scale, write_n, G: tl.constexpr, G_P: tl.constexpr,
                       ROW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    # groups whose grad is stale: overwritten (empty ones with zeros). Its own loop variable: the loop
    # below reassigns `grp` (int64), and Triton types a name once per kernel
    for wg in range(0, write_n):
        end = tl.load(offs_ptr + wg)
        start = tl.load(offs_ptr + wg - 1, mask=wg > 0, other=0)
        row = wg * ROW + offs
        w = tl.load(w_ptr + row, mask=mask & (end > start), other=0.0).to(tl.float32) * scale
        tl.store(g_ptr + row, w, mask=mask)
    g_G = tl.arange(0, G_P)
    ends = tl.load(offs_ptr + g_G, mask=g_G < G, other=0)
    starts = tl.load(offs_ptr + g_G - 1, mask=(g_G > 0) & (g_G < G), other=0)
    busy = (ends > starts) & (g_G >= write_n)
    order = tl.cumsum(busy.to(tl.int32), axis=0) - 1
    for k in range(0, tl.sum(busy.to(tl.int32), axis=0)):
        grp, _ = _kth(busy, order, g_G, g_G, k)
        row = grp * ROW + offs
        w = tl.load(w_ptr + row, mask=mask).to(tl.float32) * scale
        tl.store(g_ptr + row, tl.load(g_ptr + row, mask=mask) + w, mask=mask)


def accumulate_groups(g_GIO: torch.Tensor, w_GIO: torch.Tensor, offs_G: torch.Tensor, scale: float = 1.0,
                      write_groups: int = 0) -> None:
    """g[grp] += scale * w[grp] (fp32) for the groups that have rows (offs_G cumulative ends); empty
    groups (unused slots) are not touched: their weight gradient is zero. The first `write_groups`
    groups hold stale values instead (a grad declared zero without clearing it): they get
    scale * w[grp], or zeros when empty, whatever they held (the values of zero-then-add)."""
    G = g_GIO.shape[0]
    assert g_GIO.is_contiguous() and w_GIO.is_contiguous() and w_GIO.shape == g_GIO.shape and offs_G.numel() == G
    assert 0 <= write_groups <= G
    row = g_GIO[0].numel()
    _accumulate_kernel[(triton.cdiv(row, _BLOCK),)](g_GIO, w_GIO, offs_G, float(scale), int(write_groups), G=G,
                                                    G_P=triton.next_power_of_2(G), ROW=row, BLOCK=_BLOCK)


def prefetch(w_full: torch.Tensor, slot_expert_RB: torch.Tensor, rank: int, num_experts: int) -> None:
    """Copy the owners' rows of the experts in this rank's slots into W_full[E:] (empty slots skipped)."""
    B = slot_expert_RB.shape[1]
    row = w_full[0].numel()
    _prefetch_kernel[(triton.cdiv(row, _BLOCK),)](w_full, slot_expert_RB, rank, ROW=row, E=num_experts, B=B,
                                                  B_P=triton.next_power_of_2(B), BLOCK=_BLOCK)


def reduce_into_owner(g_local: torch.Tensor, g_slots_all: torch.Tensor, slot_expert_RB: torch.Tensor,
                      rank: int) -> None:
    """g_local[i] += every peer slot holding expert rank*epn + i, ascending (rank, slot), fp32."""
    R, B = slot_expert_RB.shape
    epn = g_local.shape[0]
    row = g_local[0].numel()
    _reduce_kernel[(triton.cdiv(row, _BLOCK),)](g_local, g_slots_all, slot_expert_RB, rank, ROW=row, R=R, B=B,
                                                B_P=triton.next_power_of_2(B), EPN=epn, BLOCK=_BLOCK)


def zero_slots(g_slots_all: torch.Tensor, slot_expert_RB: torch.Tensor, rank: int) -> None:
    """Zero this rank's occupied reduce slots."""
    B = slot_expert_RB.shape[1]
    row = g_slots_all[0, 0].numel()
    _zero_kernel[(triton.cdiv(row, _BLOCK),)](g_slots_all, slot_expert_RB, rank, ROW=row, B=B,
                                              B_P=triton.next_power_of_2(B), BLOCK=_BLOCK)
