"""Triton kernel of the planner's shared part (SPEC 5.2-5.4), bitwise equal to
`moonep.planner.plan_shared` (the specification).

One program (one CTA) holds the whole problem in registers as small tiles: R ranks (padded to a
power of two R_P), epn experts per home group (EPN_P), G = E + B groups (G_P). It runs the same
greedy steps as the PyTorch planner, with the same tie rules (tl.argmax / tl.argmin keep the lowest
index on ties, as torch.argmax does):
    1. count_E, group sums, balance = group - cap
    2. receiver filling: R - 1 masked steps over the [R_P] balance vector, quota tile [R_P, R_P]
    3. quota split: epn + R - 1 masked steps, every donor h at once (rows of the [R_P, R_P] quota
       tile and the [R_P, EPN_P] remaining tile); alloc lives in a [R_P, EPN_P, R_P] tile
    4. slots: remote experts with tokens, ascending expert id, by a cumulative sum over e
    5. group rows and offs: rows stored to global memory, a CTA barrier, then read back as a
       [R_P, G_P] tile for the padded cumulative sum
Everything else of a plan (receive caps, token destinations) stays in PyTorch; with
BufferConfig.plan_graph the whole planner is one CUDA graph replay.

Why Triton and not CuTe DSL (the issue asks for CuTe DSL): this machine cannot compile CuTe DSL
without a GPU driver, while Triton's interpreter runs this kernel on the CPU bitwise against the
PyTorch planner before any device time is spent; the CuTe DSL port is the next step.
Padded lanes: quota/remaining get -1 in padded columns so argmax never picks them, 0 in padded rows
so their `take` is 0; balance gets the dtype's extreme values for argmax/argmin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BIG = tl.constexpr(2**30)


@triton.jit
def _plan_shared_kernel(counts_ptr, cap_ptr, quota_ptr, alloc_ptr, slot_ptr, group_ptr, rows_ptr, offs_ptr,
                        R: tl.constexpr, EPN: tl.constexpr, B: tl.constexpr, PAD: tl.constexpr,
                        R_P: tl.constexpr, EPN_P: tl.constexpr, G_P: tl.constexpr):
    E: tl.constexpr = R * EPN
    G: tl.constexpr = E + B
    h_R = tl.arange(0, R_P)
    i_I = tl.arange(0, EPN_P)
    ok_R = h_R < R
    ok_HI = (h_R[:, None] < R) & (i_I[None, :] < EPN)
    e_HI = h_R[:, None] * EPN + i_I[None, :]
    # 1. tokens per expert (as [home, local index]) and per home group
    count_HI = tl.zeros([R_P, EPN_P], dtype=tl.int32)
    for r in tl.static_range(R):
        count_HI += tl.load(counts_ptr + r * E + e_HI, mask=ok_HI, other=0)
    group_R = tl.sum(count_HI, axis=1)
    cap_R = tl.load(cap_ptr + h_R, mask=ok_R, other=0).to(tl.int32)
    bal = group_R - cap_R
    # 2. receiver filling
    d_RR = tl.arange(0, R_P)[None, :]
    hrow_RR = h_R[:, None]
    quota = tl.zeros([R_P, R_P], dtype=tl.int32)
    for _ in tl.static_range(R - 1):
        h = tl.argmax(tl.where(ok_R, bal, -_BIG), axis=0)
        u = tl.argmin(tl.where(ok_R, bal, _BIG), axis=0)
        bal_h = tl.sum(tl.where(h_R == h, bal, 0), axis=0)
        bal_u = tl.sum(tl.where(h_R == u, bal, 0), axis=0)
        active = bal_h > 0
        quota += tl.where((hrow_RR == h) & (d_RR == u) & active, -bal_u, 0)
        new_h = bal_h + tl.where(active, bal_u, 0)
        new_u = tl.where(active, 0, bal_u)
        bal = tl.where(h_R == u, new_u, bal)
        bal = tl.where(h_R == h, new_h, bal)
    tl.store(quota_ptr + hrow_RR * R + d_RR, quota.to(tl.int64), mask=(hrow_RR < R) & (d_RR < R))
    # 3. quota -> experts, all donors at once
    q_tile = tl.where(d_RR < R, quota, -1)
    q_tile = tl.where(hrow_RR < R, q_tile, 0)
    m_tile = tl.where(i_I[None, :] < EPN, count_HI, -1)
    m_tile = tl.where(h_R[:, None] < R, m_tile, 0)
    i_3 = i_I[None, :, None]
    d_3 = tl.arange(0, R_P)[None, None, :]
    alloc = tl.zeros([R_P, EPN_P, R_P], dtype=tl.int32)
    for _ in tl.range(EPN + R - 1):
        d = tl.argmax(q_tile, axis=1)  # [R_P]
        q = tl.sum(tl.where(d_RR == d[:, None], q_tile, 0), axis=1)
        le = tl.argmax(m_tile, axis=1)
        rem = tl.sum(tl.where(i_I[None, :] == le[:, None], m_tile, 0), axis=1)
        take = tl.minimum(q, rem)
        q_tile -= tl.where(d_RR == d[:, None], take[:, None], 0)
        m_tile -= tl.where(i_I[None, :] == le[:, None], take[:, None], 0)
        alloc += tl.where((i_3 == le[:, None, None]) & (d_3 == d[:, None, None]), take[:, None, None], 0)
    home_rest = tl.where(i_I[None, :] < EPN, m_tile, 0)
    alloc += tl.where(d_3 == h_R[:, None, None], home_rest[:, :, None], 0)
    # 4. slots: remote experts with tokens, in ascending expert id per receiving rank
    e_3 = h_R[:, None, None] * EPN + i_3
    ok_3 = (h_R[:, None, None] < R) & (i_3 < EPN) & (d_3 < R)
    remote = ok_3 & (alloc > 0) & (h_R[:, None, None] != d_3)
    remote_flat = tl.reshape(remote.to(tl.int32), [R_P * EPN_P, R_P])
    slot_flat = tl.cumsum(remote_flat, axis=0) - 1
    slot_3 = tl.reshape(slot_flat, [R_P, EPN_P, R_P])
    in_slot = remote & (slot_3 < B)
    group_3 = tl.where(in_slot, E + slot_3, e_3)
    tl.store(alloc_ptr + e_3 * R + d_3, alloc, mask=ok_3)
    tl.store(group_ptr + e_3 * R + d_3, group_3.to(tl.int64), mask=ok_3)
    tl.store(slot_ptr + d_3 * B + slot_3, e_3, mask=in_slot)
    # 5. rows per W_full row on each rank, then padded cumulative ends
    tl.store(rows_ptr + d_3 * G + e_3, tl.where(in_slot, 0, alloc), mask=ok_3)
    tl.store(rows_ptr + d_3 * G + E + slot_3, alloc, mask=in_slot)
    tl.debug_barrier()
    g_G = tl.arange(0, G_P)[None, :]
    ok_RG = (hrow_RR < R) & (g_G < G)
    rows = tl.load(rows_ptr + hrow_RR * G + g_G, mask=ok_RG, other=0)
    padded = (rows + PAD - 1) // PAD * PAD
    tl.store(offs_ptr + hrow_RR * G + g_G, tl.cumsum(padded, axis=1), mask=ok_RG)


def plan_shared(counts_RE: torch.Tensor, cap_R: torch.Tensor, num_slots: int, token_padding: int
                ) -> tuple[torch.Tensor, ...]:
    """Same outputs as moonep.planner.plan_shared, from one kernel launch (no host sync)."""
    R, E = counts_RE.shape
    epn, B = E // R, num_slots
    G = E + B
    dev = counts_RE.device
    quota = torch.empty(R, R, dtype=torch.int64, device=dev)
    alloc = torch.empty(E, R, dtype=torch.int32, device=dev)
    slot = torch.full((R, B), -1, dtype=torch.int32, device=dev)
    group = torch.empty(E, R, dtype=torch.int64, device=dev)
    rows = torch.zeros(R, G, dtype=torch.int32, device=dev)
    offs = torch.empty(R, G, dtype=torch.int32, device=dev)
    _plan_shared_kernel[(1,)](
        counts_RE.to(torch.int32).contiguous(), cap_R.contiguous(), quota, alloc, slot, group, rows, offs,
        R=R, EPN=epn, B=B, PAD=token_padding, R_P=triton.next_power_of_2(R),
        EPN_P=triton.next_power_of_2(epn), G_P=triton.next_power_of_2(G), num_warps=8,
    )
    return quota, alloc, slot, group, rows, offs
