"""The fused planner's Triton kernels (the protocol is in moonep.planner.fused, which launches them;
what was measured and rejected in docs/performance.md): `_chunk_match_kernel` (step 1: per-chunk
histograms and ranks inside the chunk), `_prefix_kernel` (step 1: prefixes over chunks, the local
histogram to every peer), `_shared_kernel` (step 3, one program per rank) and `_dest_kernel` (step 4).

The shared kernel's tiles are per rank: [epn, R] allocations of two groups, [R, R] quotas, [G] rows of
one rank (R padded to a power of two R_P, epn to EPN_P, G = E + B to G_P). An argmax is one
max-reduction of a key (value in the high bits, the index's complement in the low bits; int32 where
R * max_tokens * K leaves room for the index bits, else int64); padded lanes never win (quota and
remaining -1, balance masked). Reductions and scans that can run together are one tl.reduce /
tl.associative_scan of several operands: one exchange between warps instead of one each."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _popcount(x, HW: tl.constexpr):
    """Set bits of each int32 lane: the popc instruction on the GPU, SWAR arithmetic in Triton's
    interpreter (which has no libdevice)."""
    if HW:
        return libdevice.popc(x)
    else:
        x = x - ((x >> 1) & 0x55555555)  # the arithmetic shifts' sign bits are masked off
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return (x * 0x01010101) >> 24


@triton.jit
def _chunk_match_kernel(topk_ptr, rank_ptr, chunk_hist_ptr, plane_ptr, num_entries, E,
                        CHUNK: tl.constexpr, BITS: tl.constexpr, BITS_P: tl.constexpr, E_P: tl.constexpr,
                        HW_POPC: tl.constexpr):
    """The chunk's histogram and ranks without a sort: bit-sliced matching against 32-entry blocks.

    Plane b of block J is the 32-bit word whose bit w is bit b of expert[32 J + w]; the entries of
    block J with entry i's expert are then the AND over b of plane b or its complement (bit b of
    i's expert), 32 comparisons in BITS logic operations. Entry i's rank is the popcount of its
    matches in the blocks before its own plus the matches below its lane in its own block; its
    expert's count in the chunk is the popcount over all blocks, stored by every entry of that
    expert (equal values) into the chunk's histogram row after the row is zeroed. The planes pass
    through `plane_ptr` (global scratch, this program's [CHUNK / 32, BITS_P] words) so that the
    matching loop reads each as a scalar."""
    NB: tl.constexpr = CHUNK // 32
    c = tl.program_id(0)
    blk3 = tl.arange(0, NB)[:, None, None]
    lane3 = tl.arange(0, 32)[None, :, None]
    bit3 = tl.arange(0, BITS_P)[None, None, :]
    entry3 = c * CHUNK + blk3 * 32 + lane3
    e3 = tl.load(topk_ptr + entry3, mask=entry3 < num_entries, other=E).to(tl.int32)  # padding: E, no expert
    planes = tl.sum(((e3 >> bit3) & 1) << lane3, axis=1)  # distinct bits: the sum is their OR
    plane_c = plane_ptr + c * (NB * BITS_P)
    tl.store(plane_c + tl.arange(0, NB)[:, None] * BITS_P + tl.arange(0, BITS_P)[None, :], planes)
    bins = tl.arange(0, E_P)
    tl.store(chunk_hist_ptr + c * E + bins, tl.zeros([E_P], dtype=tl.int32), mask=bins < E)
    tl.debug_barrier()  # the planes and the zero row, written by other threads of this program
    i = tl.arange(0, CHUNK)
    entry = c * CHUNK + i
    ok = entry < num_entries
    expert = tl.load(topk_ptr + entry, mask=ok, other=E).to(tl.int32)
    blk = i // 32
    count = tl.zeros([CHUNK], dtype=tl.int32)  # matches in blocks 0..J
    before = tl.zeros([CHUNK], dtype=tl.int32)  # matches in the blocks before i's own
    own = tl.zeros([CHUNK], dtype=tl.int32)  # match word of i's own block
    for J in tl.static_range(NB):
        match = tl.full([CHUNK], -1, dtype=tl.int32)
        for b in tl.static_range(BITS):
            match = match & ~(tl.load(plane_c + J * BITS_P + b) ^ -((expert >> b) & 1))
        before = tl.where(blk == J, count, before)
        own = tl.where(blk == J, match, own)
        count += _popcount(match, HW_POPC)
    below = (1 << (i & 31)) - 1  # lanes under i's (lane 31: INT_MIN - 1 wraps to 0x7FFFFFFF)
    tl.store(rank_ptr + entry, before + _popcount(own & below, HW_POPC), mask=ok)
    tl.store(chunk_hist_ptr + c * E + expert, count, mask=ok)


@triton.jit(do_not_specialize=["rank", "hist_rank_stride", "hist_row_stride"])
def _prefix_kernel(chunk_hist_ptr, hist_ptr, num_chunks, rank, hist_rank_stride, hist_row_stride, E,
                   R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """Experts [e0, e0 + BLOCK_E) of this program: per-chunk histograms -> exclusive prefixes over
    chunks (in place), and their totals (the local histogram) into row `rank` of every rank's hist
    region."""
    e0 = tl.program_id(0) * BLOCK_E
    cc = tl.arange(0, BLOCK_C)[:, None]
    ee = e0 + tl.arange(0, BLOCK_E)
    e_ok = ee < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        m = ((c0 + cc) < num_chunks) & e_ok[None, :]
        ptrs = chunk_hist_ptr + (c0 + cc) * E + ee[None, :]
        tile = tl.load(ptrs, mask=m, other=0, cache_modifier=".cg")  # written by other SMs
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=m)
        carry += tl.sum(tile, axis=0)
    for r in tl.static_range(R):  # int64: the rank stride spans the whole comm segment
        row = hist_ptr + r * hist_rank_stride.to(tl.int64) + rank * hist_row_stride
        tl.store(row + ee, carry, mask=e_ok)


@triton.jit
def _key_max2(value0, value1, idx, ok, IDX_BITS: tl.constexpr, KEY64: tl.constexpr):
    """(index, value) of the largest `value0` and of the largest `value1` over the `ok` lanes of two
    1-D blocks, the lowest index on ties (torch.argmax's rule), in one reduction of two operands:
    a key holds the value in its high bits and the complement of the index in its low IDX_BITS
    bits. Keys are int32 where |value| < 2**(30 - IDX_BITS) holds (KEY64 False: one shuffle per
    reduction step instead of two plus 64-bit compares), else int64."""
    LOW: tl.constexpr = (1 << IDX_BITS) - 1
    if KEY64:
        k0 = tl.where(ok, (value0.to(tl.int64) << IDX_BITS) | (LOW - idx).to(tl.int64), -(2**62))
        k1 = tl.where(ok, (value1.to(tl.int64) << IDX_BITS) | (LOW - idx).to(tl.int64), -(2**62))
    else:
        k0 = tl.where(ok, (value0 << IDX_BITS) | (LOW - idx), -(2**31))
        k1 = tl.where(ok, (value1 << IDX_BITS) | (LOW - idx), -(2**31))
    k0, k1 = tl.reduce((k0, k1), 0, _max_max)
    return ((LOW - (k0 & LOW)).to(tl.int32), (k0 >> IDX_BITS).to(tl.int32),
            (LOW - (k1 & LOW)).to(tl.int32), (k1 >> IDX_BITS).to(tl.int32))


@triton.jit
def _key_max_min(value, idx, ok, IDX_BITS: tl.constexpr, KEY64: tl.constexpr):
    """(index, value) of the largest and of the smallest `value` over the `ok` lanes, the lowest
    index on ties for both, in one reduction (keys as in _key_max2; the min key holds the index)."""
    LOW: tl.constexpr = (1 << IDX_BITS) - 1
    if KEY64:
        hi = tl.where(ok, (value.to(tl.int64) << IDX_BITS) | (LOW - idx).to(tl.int64), -(2**62))
        lo = tl.where(ok, (value.to(tl.int64) << IDX_BITS) | idx.to(tl.int64), 2**62)
    else:
        hi = tl.where(ok, (value << IDX_BITS) | (LOW - idx), -(2**31))
        lo = tl.where(ok, (value << IDX_BITS) | idx, 2**31 - 1)
    hi, lo = tl.reduce((hi, lo), 0, _max_min)
    return ((LOW - (hi & LOW)).to(tl.int32), (hi >> IDX_BITS).to(tl.int32),
            (lo & LOW).to(tl.int32), (lo >> IDX_BITS).to(tl.int32))


@triton.jit
def _max_max(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _max_min(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.minimum(b0, b1)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add4(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _row(tile, rows, r):
    """Row r of a 2-D tile whose row indices are `rows` (a masked sum: no data-dependent indexing)."""
    return tl.sum(tl.where(rows[:, None] == r, tile, 0), axis=0)


@triton.jit
def _col(tile, cols, c):
    """Column c of a 2-D tile whose column indices are `cols`."""
    return tl.sum(tl.where(cols[None, :] == c, tile, 0), axis=1)


@triton.jit
def _pad(rows, PAD: tl.constexpr):
    return (rows + PAD - 1) // PAD * PAD


@triton.jit(do_not_specialize=["rank", "cap_base", "cap_rem"])
def _shared_kernel(hist_ptr, counts_ptr, cap_ptr, quota_ptr, alloc_ptr, slot_ptr, rows_ptr, offs_ptr,
                   end_ptr, rowbase_ptr, rank, cap_base, cap_rem,
                   R: tl.constexpr, EPN: tl.constexpr, B: tl.constexpr, PAD: tl.constexpr,
                   R_P: tl.constexpr, EPN_P: tl.constexpr, G_P: tl.constexpr, B_P: tl.constexpr,
                   LOG_R_P: tl.constexpr, LOG_EPN_P: tl.constexpr, KEY64: tl.constexpr):
    """Program d: the shared plan's rows of rank d and of home group d's experts (docs/moonep.md §5.1-§5.4).

    Every program repeats the receiver filling (R - 1 steps on [R] vectors); program d then splits
    the quotas of its own group d and of its donor h (the one group with quota[h, d] > 0, §5.2),
    which gives every token count rank d's rows depend on. Writes: counts_RE[d], group_rows_RG[d],
    offs_RG[d], slot_expert_RB[d], alloc_ER and end_ER of group d's experts, rowbase_ER[:, d] of
    the experts with tokens on d; program 0 also cap_R and quota_RR. end and rowbase are relative
    to this rank's entries: the tokens of e on lower ranks are subtracted (end) or added (rowbase),
    so that the destination pass needs no per-expert base."""
    E: tl.constexpr = R * EPN
    G: tl.constexpr = E + B
    d = tl.program_id(0)
    g_R = tl.arange(0, R_P)
    i_I = tl.arange(0, EPN_P)
    ok_R = g_R < R
    ok_I = i_I < EPN
    ok_GI = ok_R[:, None] & ok_I[None, :]
    e_GI = g_R[:, None] * EPN + i_I[None, :]
    # 1. tokens per expert (over all ranks) and on ranks below this one, counts_RE row d copied out
    count_GI = tl.zeros([R_P, EPN_P], dtype=tl.int32)
    base_GI = tl.zeros([R_P, EPN_P], dtype=tl.int32)
    for r in tl.static_range(R):
        c_GI = tl.load(hist_ptr + r * E + e_GI, mask=ok_GI, other=0)
        count_GI += c_GI
        base_GI += tl.where(r < rank, c_GI, 0)
    tl.store(counts_ptr + d * E + e_GI, tl.load(hist_ptr + d * E + e_GI, mask=ok_GI, other=0), mask=ok_GI)
    group_R = tl.sum(count_GI, axis=1)
    cap_R = cap_base + (g_R < cap_rem).to(tl.int32)
    # 2. receiver filling (§5.2), identical in every program; on the way, row d of the quotas
    #    (group d's receivers) and d's donor: the step that fills receiver d (at most one, §5.2;
    #    none: group 0 and quota 0, the column argmax of the specification's zero column)
    hrow = g_R[:, None]
    ucol = g_R[None, :]
    quota = tl.zeros([R_P, R_P], dtype=tl.int32)
    q_own = tl.zeros([R_P], dtype=tl.int32)
    h_of_d = d * 0
    q_dh = d * 0
    bal = group_R - cap_R
    for _ in tl.static_range(R - 1):
        h, bal_h, u, bal_u = _key_max_min(bal, g_R, ok_R, LOG_R_P, KEY64)
        active = bal_h > 0
        quota += tl.where((hrow == h) & (ucol == u) & active, -bal_u, 0)
        q_own += tl.where((g_R == u) & (h == d) & active, -bal_u, 0)
        fills_d = active & (u == d)
        h_of_d = tl.where(fills_d, h, h_of_d)
        q_dh = tl.where(fills_d, -bal_u, q_dh)
        new_h = bal_h + tl.where(active, bal_u, 0)
        new_u = tl.where(active, 0, bal_u)
        bal = tl.where(g_R == u, new_u, bal)
        bal = tl.where(g_R == h, new_h, bal)
    ok_RR = (hrow < R) & (ucol < R)
    tl.store(cap_ptr + g_R, cap_R.to(tl.int64), mask=ok_R & (d == 0))
    tl.store(quota_ptr + hrow * R + ucol, quota.to(tl.int64), mask=ok_RR & (d == 0))
    # 3. quota split (§5.3) of group d and of d's donor h, the two chains interleaved; each
    #    stops once its quotas are closed (the specification's remaining steps move 0 tokens); the
    #    chains' argmaxes are paired into one reduction each (one exchange between warps per step)
    h = h_of_d
    has_donor = q_dh > 0
    q_own = tl.where(ok_R, q_own, -1)  # padded receivers: never the largest quota
    q_don = tl.where(ok_R & has_donor, _row(quota, g_R, h), -1)
    m_own, base_own = tl.reduce((tl.where(g_R[:, None] == d, count_GI, 0), tl.where(g_R[:, None] == d, base_GI, 0)),
                                0, _add2)  # rows d of the counts and bases, one exchange
    m_don, base_don = tl.reduce((tl.where(g_R[:, None] == h, count_GI, 0), tl.where(g_R[:, None] == h, base_GI, 0)),
                                0, _add2)
    m_own = tl.where(ok_I, m_own, -1)  # padded experts: never the fullest
    m_don = tl.where(ok_I, m_don, -1)
    i2 = i_I[:, None]
    d2 = g_R[None, :]
    a_own = tl.zeros([EPN_P, R_P], dtype=tl.int32)  # alloc[d * EPN + i, rank]
    a_don = tl.zeros([EPN_P, R_P], dtype=tl.int32)  # alloc[h * EPN + i, rank]
    to_o, qv_o, to_d, qv_d = _key_max2(q_own, q_don, g_R, ok_R, LOG_R_P, KEY64)
    step = 0
    while (step < EPN + R - 1) & ((qv_o > 0) | (qv_d > 0)):
        from_o, mv_o, from_d, mv_d = _key_max2(m_own, m_don, i_I, ok_I, LOG_EPN_P, KEY64)
        take_o = tl.maximum(tl.minimum(qv_o, mv_o), 0)
        take_d = tl.maximum(tl.minimum(qv_d, mv_d), 0)
        q_own = tl.where(g_R == to_o, q_own - take_o, q_own)
        q_don = tl.where(g_R == to_d, q_don - take_d, q_don)
        m_own = tl.where(i_I == from_o, m_own - take_o, m_own)
        m_don = tl.where(i_I == from_d, m_don - take_d, m_don)
        a_own += tl.where((i2 == from_o) & (d2 == to_o), take_o, 0)
        a_don += tl.where((i2 == from_d) & (d2 == to_d), take_d, 0)
        to_o, qv_o, to_d, qv_d = _key_max2(q_own, q_don, g_R, ok_R, LOG_R_P, KEY64)
        step += 1
    a_own += tl.where(d2 == d, tl.where(ok_I, m_own, 0)[:, None], 0)  # the rest stays home
    a_don += tl.where(d2 == h, tl.where(ok_I, m_don, 0)[:, None], 0)
    ok_IR = (i2 < EPN) & (d2 < R)
    e_own = d * EPN + i_I
    tl.store(alloc_ptr + e_own[:, None] * R + d2, a_own, mask=ok_IR)
    tl.store(end_ptr + e_own[:, None] * R + d2, tl.cumsum(a_own, axis=1) - base_own[:, None], mask=ok_IR)
    # 4. rank d's groups: its local experts, the donor's experts (their home rows, or slots in
    #    ascending expert id while B lasts: §5.4), nothing else; rows and padded cumulative ends
    local_I = _col(a_own, g_R, d)
    remote_I = tl.where(has_donor, _col(a_don, g_R, d), 0)
    got = ok_I & (remote_I > 0)
    loc_pad = _pad(local_I, PAD)
    # scans and sums paired (several operands per exchange between warps)
    got_cum, loc_cum = tl.associative_scan((got.to(tl.int32), loc_pad), 0, _add2)
    slot_I = got_cum - 1
    in_slot = got & (slot_I < B)
    home_I = tl.where(in_slot, 0, remote_I)  # remote tokens on the expert's home row (slots ran out)
    home_pad = _pad(home_I, PAD)
    slot_pad = tl.where(in_slot, _pad(remote_I, PAD), 0)
    home_cum, slot_cum = tl.associative_scan((home_pad, slot_pad), 0, _add2)
    num_used, loc_tot, home_tot, slot_tot = tl.reduce((in_slot.to(tl.int32), loc_pad, home_pad, slot_pad), 0, _add4)
    loc_start = d * EPN
    don_start = h * EPN
    before_loc = tl.where(has_donor & (don_start < loc_start), home_tot, 0)
    before_don = tl.where(loc_start < don_start, loc_tot, 0)
    homes_tot = loc_tot + home_tot
    loc_end = loc_cum + before_loc
    don_end = home_cum + before_don
    slot_end = slot_cum + homes_tot
    g_G = tl.arange(0, G_P)
    in_loc = (g_G >= loc_start) & (g_G < loc_start + EPN)
    in_don = has_donor & (g_G >= don_start) & (g_G < don_start + EPN)
    in_used = (g_G >= E) & (g_G < E + num_used)
    rest = (g_G < G) & ~in_loc & ~in_don & ~in_used  # empty groups: 0 rows, the end of what precedes
    rest_end = (tl.where(g_G >= loc_start + EPN, loc_tot, 0) + tl.where(g_G >= E + num_used, slot_tot, 0)
                + tl.where(has_donor & (g_G >= don_start + EPN), home_tot, 0))
    tl.store(rows_ptr + d * G + g_G, tl.zeros([G_P], dtype=tl.int32), mask=rest)
    tl.store(offs_ptr + d * G + g_G, rest_end, mask=rest)
    tl.store(rows_ptr + d * G + loc_start + i_I, local_I, mask=ok_I)
    tl.store(offs_ptr + d * G + loc_start + i_I, loc_end, mask=ok_I)
    tl.store(rows_ptr + d * G + don_start + i_I, home_I, mask=ok_I & has_donor)
    tl.store(offs_ptr + d * G + don_start + i_I, don_end, mask=ok_I & has_donor)
    tl.store(rows_ptr + d * G + E + slot_I, remote_I, mask=in_slot)
    tl.store(offs_ptr + d * G + E + slot_I, slot_end, mask=in_slot)
    tl.store(slot_ptr + d * B + slot_I, don_start + i_I, mask=in_slot)
    j_B = tl.arange(0, B_P)
    tl.store(slot_ptr + d * B + j_B, tl.full([B_P], -1, tl.int32), mask=(j_B >= num_used) & (j_B < B))
    # 5. rowbase[e, d] for the experts with tokens on d: the receive row of e's entry number 0 if it
    #    went to d (group start minus e's entries on lower ranks), plus the tokens of e on lower
    #    source ranks
    tl.store(rowbase_ptr + e_own * R + d, loc_end - loc_pad - tl.sum(tl.where(d2 < d, a_own, 0), axis=1) + base_own,
             mask=ok_I)
    don_group_start = tl.where(in_slot, slot_end - slot_pad, don_end - home_pad)
    tl.store(rowbase_ptr + (don_start + i_I) * R + d,
             don_group_start - tl.sum(tl.where(d2 < d, a_don, 0), axis=1) + base_don, mask=got)


@triton.jit
def _dest_kernel(topk_ptr, rank_ptr, prefix_ptr, end_ptr, rowbase_ptr,
                 dst_rank_ptr, dst_row_ptr, copy_row_ptr, sent_ptr, num_tokens, E, K,
                 R: tl.constexpr, R_P: tl.constexpr, K_P: tl.constexpr,
                 BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    k = tl.arange(0, K_P)[None, :]
    ok = (t < num_tokens) & (k < K)
    entry = t * K + k
    expert = tl.load(topk_ptr + entry, mask=ok, other=0).to(tl.int32)
    # position among this rank's entries of the expert (end and rowbase are relative to them)
    pos = (tl.load(prefix_ptr + (entry // CHUNK) * E + expert, mask=ok, other=0)
           + tl.load(rank_ptr + entry, mask=ok, other=0))
    # ranks whose share of the expert ends at or before pos: one contiguous [R] row per entry
    d3 = tl.arange(0, R_P)[None, None, :]
    end = tl.load(end_ptr + expert[:, :, None] * R + d3, mask=ok[:, :, None] & (d3 < R), other=2**30)
    dst = tl.sum((end <= pos[:, :, None]).to(tl.int32), axis=2)
    row = tl.load(rowbase_ptr + expert * R + dst, mask=ok & (dst < R), other=0) + pos
    tl.store(dst_rank_ptr + entry, dst, mask=ok)
    tl.store(dst_row_ptr + entry, row, mask=ok)
    # dedup: the lowest k of the token on each destination rank carries the row (per token and
    # rank in the [R] tile of the ends: its first k, then that k's row); rows on a rank are
    # distinct per entry, so an entry is the carrier exactly when its copy row is its own row
    k3 = tl.arange(0, K_P)[None, :, None]
    on_d = (dst[:, :, None] == d3) & (k3 < K)
    first_TR = tl.min(tl.where(on_d, k3, K_P), axis=1)
    row_TR = tl.sum(tl.where(on_d & (k3 == first_TR[:, None, :]), row[:, :, None], 0), axis=1)
    copy = tl.sum(tl.where(on_d, row_TR[:, None, :], 0), axis=2)
    tl.store(copy_row_ptr + entry, copy, mask=ok)
    tl.store(sent_ptr + entry, (copy == row).to(tl.uint8), mask=ok)
