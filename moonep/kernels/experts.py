"""Triton kernels for the expert-weight side: prefetch_weight and reduce_grad (issue 4).

The PyTorch path (moonep.pools) is sync-free, so it cannot know which slots are occupied: prefetch
copies all B slots (empty ones onto themselves) and reduce_grad reads every slot of every peer,
masked. Measured on 2xH200 (2026-11-29, E=96, R=2, one expert copy of 88 MB): prefetch 4.7 ms,
reduce_grad 17.7 ms. These kernels read the slot table on the device and skip empty slots, so the
traffic is the expert copies themselves.

prefetch: grid (row chunks, B); program (c, j) reads e = slot_expert[rank, j]; if e >= 0 it copies
    chunk c of W_full[e] (the owner's row, read over NVLink) into W_full[E + j]. Only this rank's
    slots are written; stream order after dispatch's barriers makes the owners' rows current.
accumulate_groups: the expert_swiglu backward's weight gradient (bf16 from the grouped GEMM) added
    into the fp32 grad mirror (W_compact rows) for groups with rows only; on k3_small_moe at low
    skew half of the groups are empty slots.
reduce_grad: grid (row chunks, epn); program (c, i) accumulates, for d = 0..R-1 ascending (d !=
    rank) and j = 0..B-1 ascending, every slot (d, j) holding expert rank*epn + i into g_local[i]
    in fp32, one add per contribution: the PyTorch path's order (a rank holds at most one copy of
    an expert, so at most one contribution per d), hence the same values (the PyTorch path also
    adds +0.0 for empty slots, which can only turn a -0.0 into +0.0). Experts without copies are
    not touched (a vector scan of the slot table first): reading and rewriting all of g_local cost
    8 ms per step of k3_small_moe (2xH200, 2026-11-29), and a scalar scan (B serial loads in each
    program) made reduce_grad ~1 ms per layer at 5 copies. Then, after the
    "reduce_grad:read" barrier, `zero_slots` clears this rank's occupied slots (the others were
    never written: grads of empty groups are zero).

Checked bitwise against the PyTorch path in Triton's interpreter on the CPU heap (R = 2, 4) and on
2xH200 (tests/moonep/gpu/test_expert_kernels.py, 2026-11-29).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _prefetch_kernel(w_ptr, slot_ptr, rank, ROW: tl.constexpr, E: tl.constexpr, B: tl.constexpr,
                     BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)  # element offsets pass 2**31 at K3 sizes
    j = tl.program_id(1).to(tl.int64)
    e = tl.load(slot_ptr + rank * B + j).to(tl.int64)
    if e >= 0:
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ROW
        vals = tl.load(w_ptr + e * ROW + offs, mask=mask)
        tl.store(w_ptr + (E + j) * ROW + offs, vals, mask=mask)


@triton.jit
def _reduce_kernel(g_local_ptr, g_slots_ptr, slot_ptr, rank, ROW: tl.constexpr, R: tl.constexpr, B: tl.constexpr,
                   B_P: tl.constexpr, EPN: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    expert = rank * EPN + i
    j_B = tl.arange(0, B_P)
    # copies of this expert anywhere? one vector load of each peer's slot row (most experts have
    # none, and touching their grad rows would cost a full read + write of g_local)
    copies = tl.full([], 0, tl.int32)
    for d in tl.static_range(R):
        if d != rank:
            slots = tl.load(slot_ptr + d * B + j_B, mask=j_B < B, other=-1)
            copies += tl.sum((slots == expert).to(tl.int32), axis=0)
    if copies > 0:
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ROW
        acc = tl.load(g_local_ptr + i * ROW + offs, mask=mask)
        for d in tl.static_range(R):  # ascending d; a rank holds at most one copy of an expert
            if d != rank:
                slots = tl.load(slot_ptr + d * B + j_B, mask=j_B < B, other=-1)
                hit = slots == expert
                if tl.sum(hit.to(tl.int32), axis=0) > 0:
                    j = tl.argmax(hit.to(tl.int32), axis=0).to(tl.int64)
                    acc += tl.load(g_slots_ptr + (d * B + j) * ROW + offs, mask=mask)
        tl.store(g_local_ptr + i * ROW + offs, acc, mask=mask)


@triton.jit
def _zero_kernel(g_slots_ptr, slot_ptr, rank, ROW: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    if tl.load(slot_ptr + rank * B + j) >= 0:
        offs = c * BLOCK + tl.arange(0, BLOCK)
        tl.store(g_slots_ptr + (rank * B + j) * ROW + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < ROW)


@triton.jit
def _accumulate_kernel(g_ptr, w_ptr, offs_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    end = tl.load(offs_ptr + grp)
    start = tl.where(grp > 0, tl.load(offs_ptr + tl.maximum(grp - 1, 0)), 0)
    if end > start:
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ROW
        base = grp.to(tl.int64) * ROW
        acc = tl.load(g_ptr + base + offs, mask=mask) + tl.load(w_ptr + base + offs, mask=mask).to(tl.float32)
        tl.store(g_ptr + base + offs, acc, mask=mask)


def accumulate_groups(g_GIO: torch.Tensor, w_GIO: torch.Tensor, offs_G: torch.Tensor) -> None:
    """g[grp] += w[grp] (fp32) for the groups that have rows (offs_G cumulative ends); empty groups
    (unused slots) are not touched: their weight gradient is zero."""
    G = g_GIO.shape[0]
    assert g_GIO.is_contiguous() and w_GIO.is_contiguous() and w_GIO.shape == g_GIO.shape and offs_G.numel() == G
    row = g_GIO[0].numel()
    _accumulate_kernel[(triton.cdiv(row, _BLOCK), G)](g_GIO, w_GIO, offs_G, ROW=row, BLOCK=_BLOCK)


def prefetch(w_full: torch.Tensor, slot_expert_RB: torch.Tensor, rank: int, num_experts: int) -> None:
    """Copy the owners' rows of the experts in this rank's slots into W_full[E:] (empty slots skipped)."""
    B = slot_expert_RB.shape[1]
    row = w_full[0].numel()
    _prefetch_kernel[(triton.cdiv(row, _BLOCK), B)](w_full, slot_expert_RB, rank, ROW=row, E=num_experts, B=B,
                                                    BLOCK=_BLOCK)


def reduce_into_owner(g_local: torch.Tensor, g_slots_all: torch.Tensor, slot_expert_RB: torch.Tensor,
                      rank: int) -> None:
    """g_local[i] += every peer slot holding expert rank*epn + i, ascending (rank, slot), fp32."""
    R, B = slot_expert_RB.shape
    epn = g_local.shape[0]
    row = g_local[0].numel()
    _reduce_kernel[(triton.cdiv(row, _BLOCK), epn)](g_local, g_slots_all, slot_expert_RB, rank, ROW=row, R=R, B=B,
                                                    B_P=triton.next_power_of_2(B), EPN=epn, BLOCK=_BLOCK)


def zero_slots(g_slots_all: torch.Tensor, slot_expert_RB: torch.Tensor, rank: int) -> None:
    """Zero this rank's occupied reduce slots."""
    B = slot_expert_RB.shape[1]
    row = g_slots_all[0, 0].numel()
    _zero_kernel[(triton.cdiv(row, _BLOCK), B)](g_slots_all, slot_expert_RB, rank, ROW=row, B=B, BLOCK=_BLOCK)
