"""Triton kernels of the dispatch and combine data path (docs/moonep.md §6.1, §6.2), bitwise equal to
the PyTorch path (moonep.datapath.reference, the specification).

Every kernel reaches the comm segment through the Buffer's all-ranks views ([R, ...] strided over one
virtual range): one base pointer plus rank * rank_stride is any peer's region, so a store to a peer is
a plain `st.global` over NVLink. Each step is one launch on the current stream; the barriers are
moonep.heap.device_barrier's, so nothing waits on the host and a fixed-s sequence can be graph-captured.

dispatch
    1. `_scatter_kernel` (sender), persistent grid over claimed token blocks: each entry's route weight
       and 8-byte (row_copy, row_src) record (with "destination" also its chain link) to its
       destination row; each token row loaded once per H chunk, stored once per destination rank
       (sent_sK) and, on this rank, into its duplicate rows too.
    2. barrier "dispatch:rows".
    3. `_expand_kernel` (receiver), local: each row's group by binary search over offs; padding rows
       marked and zeroed; peers' duplicates copied from their primary row (primary rows untouched).
combine (a row's value: y (+ add_rows) (* row_weights), in fp32)
    0. when `plan` is not the last dispatch's: barrier "combine:enter", the scatter (no rows) rewrites
       row_src and the chain links, the expand marks own padding rows, barrier "combine:meta".
    1. `_push_kernel` (destination): each valid row into its source's landing row land[src, t*K + k]
       (one row per entry: no race). "destination": `_chain_list_kernel` lists each token's rows here,
       `_push_reduce_kernel` sums them in fp32 in ascending k, rounds once and pushes one partial row
       per (token, rank) into the landing row of its first entry.
    2. barrier "combine:rows".
    3. `_reduce_kernel` (source), local: y[t] = the sum over ascending k of land[t*K + k] in fp32 (with
       "destination" over the partial rows, sent_sK), one rounding: the PyTorch path's arithmetic.
    4. barrier "combine:done": no peer pushes the next combine into land while it is read.

Memory ordering: peer stores are weak; the barrier after them runs `fence.sc.sys` then `st.release.sys`,
and the peer's `ld.acquire.sys` plus stream order make them visible to kernels queued after it there.
The scatter and the push also end every thread with `fence.sc.sys` (a fence orders its own thread's
stores only; NVLink stores over many links could otherwise land after the barrier's signal).

Measured (2xH200 NV18, 2026-11-29, R=2, S=8192, H=7168, K=8, E=96, maxvio 0.98): dispatch with a saved
plan 841 us, combine 1698 us; NCCL all-to-all 3860 / 6604 us (docs/performance.md: sweep, variants).

Rejected: a pull combine (plain peer loads are latency-bound); one copy-engine copy per row; padding
marks in the scatter (only the receiver finds a row's group cheaply); own rows stored by the expand
(100-250 us slower); a fixed grid of 32 SMs; a destination push that walks each chain itself (3x slower).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moonep.heap.device_barrier import _fence_sys

# scatter / expand / push move tiles of _TILE elements (32 KiB in bf16) with 16 warps: whole rows
# (H padded to a power of two, at most 8192 wide) so that one load serves all K stores and each CTA
# keeps 32 KiB in flight; the reduce runs many small CTAs over [4, 1024] tiles.
_TILE = 16384
_MAX_BLOCK_H = 8192
_NUM_WARPS = 16
_REDUCE_BLOCK_T, _REDUCE_BLOCK_H, _REDUCE_WARPS = 4, 1024, 4
# the expand works per row (a binary search over the groups, then the row's metadata) and copies only
# peers' duplicates: 64 rows x 256 per tile, so that one program resolves 64 rows at once (8 rows of
# whole-row tiles made 33k latency-bound programs of 512 threads per call at k3_small_moe's shape)
_EXPAND_MAX_H = 256
# combine_reduce "destination": the chains resolved per segment of _SEGMENT rows; the reduce push
# sums [primaries, <= 512] tiles of _REDUCE_PUSH_TILE elements (4 x 512 at H >= 512) with 4 warps and
# _REDUCE_PUSH_PER_SM programs per SM: two 16-byte vectors of each of the K rows per thread, the K loads
# independent of each other. Its loads wait on the row lists, so what keeps HBM busy is many small
# programs in flight, not wide ones: the fastest of the shapes benchmarks/bench_push_reduce.py sweeps at
# k3_small's and k3_small_moe's MoE layers (docs/performance.md).
_SEGMENT = 1024
_REDUCE_PUSH_TILE, _REDUCE_PUSH_MAX_H, _REDUCE_PUSH_WARPS = 2048, 512, 4
_REDUCE_PUSH_PER_SM = 8  # programs of the reduce push per program of the other kernels (`grid`)


def _reduce_push_block(H: int, tile: int = _REDUCE_PUSH_TILE) -> tuple[int, int]:
    """(primary rows per block, hidden elements per tile) of the reduce push."""
    block_h = min(triton.next_power_of_2(H), _REDUCE_PUSH_MAX_H)
    return max(1, tile // block_h), block_h


def _tile(H: int, tile: int = _TILE) -> tuple[int, int]:
    """(rows per tile, hidden elements per tile)."""
    block_h = min(triton.next_power_of_2(H), _MAX_BLOCK_H)
    return max(1, tile // block_h), block_h


@triton.jit
def _scatter_kernel(x_ptr, w_ptr, dst_rank_ptr, dst_row_ptr, copy_row_ptr, sent_ptr,
                    recv_ptr, row_weight_ptr, row_link_ptr, row_link64_ptr, row_chain_ptr,
                    s, H, x_stride, recv_rank_stride, recv_row_stride, meta_rank_stride, link_rank_stride, src_base,
                    rank, work_ptr, num_programs, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, CHAIN: tl.constexpr, FENCE: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    hh0 = tl.arange(0, BLOCK_H)
    # persistent, blocks claimed one at a time from a counter (work[0]), in token order: whatever the
    # routing, every program stays busy until the last blocks, and the kernel ends at most about one
    # block after the mean (static runs of blocks leave programs uneven: round-robin routing
    # alternates runs of tokens to each rank, and the phase waits for the busiest program).
    # The last program out (work[1] counts them) puts both counters back to 0 for the next launch.
    num_blocks = tl.cdiv(s, BLOCK_T)
    tb = tl.atomic_add(work_ptr, 1)
    while tb < num_blocks:
        t = (tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = t < s
        # metadata of every entry (t, k) into its destination row
        entry = t[:, None] * K + kk[None, :]
        e_ok = t_ok[:, None] & (kk[None, :] < K)
        d_rank = tl.load(dst_rank_ptr + entry, mask=e_ok, other=0).to(tl.int64)
        d_row = tl.load(dst_row_ptr + entry, mask=e_ok, other=0).to(tl.int64)
        meta = d_rank * meta_rank_stride + d_row  # the destination row's route weight
        rec = d_rank * link_rank_stride + d_row  # and its (row_copy, row_src) record
        src = (src_base + entry).to(tl.int32)
        if ROWS:  # the record as one 8-byte store (little-endian: row_copy low, row_src high), not two
            copy = tl.load(copy_row_ptr + entry, mask=e_ok, other=0)
            link = (src.to(tl.int64) << 32) | (copy.to(tl.int64) & 0xFFFFFFFF)
            tl.store(row_link64_ptr + rec, link, mask=e_ok)
        else:  # row_src alone (combine's refresh)
            tl.store(row_link_ptr + 2 * rec + 1, src, mask=e_ok)
        if CHAIN:  # 2 * (row of the token's next entry on the same rank, or -1) + (first entry there)
            nxt = tl.full([BLOCK_T, BLOCK_K], -1, tl.int64)
            for i in tl.static_range(K):  # j descending: the smallest later k on the same rank wins
                j = K - 1 - i
                r_j = tl.load(dst_rank_ptr + t * K + j, mask=t_ok, other=0).to(tl.int64)
                row_j = tl.load(dst_row_ptr + t * K + j, mask=t_ok, other=0).to(tl.int64)
                nxt = tl.where((d_rank == r_j[:, None]) & (kk[None, :] < j), row_j[:, None], nxt)
            first = (tl.load(sent_ptr + entry, mask=e_ok, other=0) != 0).to(tl.int64)
            tl.store(row_chain_ptr + meta, (2 * nxt + first).to(tl.int32), mask=e_ok)
        if ROWS:
            if HAS_W:
                w = tl.load(w_ptr + entry, mask=e_ok, other=0.0).to(tl.float32)
                tl.store(row_weight_ptr + meta, w, mask=e_ok)
            # per k, the entry's metadata loaded next to its store: the row goes to every entry with
            # sent_sK, and on this rank also to every duplicate (row_copy != row; an absent entry of
            # entries mode has row_copy == row, the trash row, and stays out), which the receiver's
            # expand then leaves alone
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + hh0
                m = t_ok[:, None] & (hh < H)[None, :]
                tile = tl.load(x_ptr + t[:, None] * x_stride + hh[None, :], mask=m)
                for k in tl.static_range(K):
                    sent = tl.load(sent_ptr + t * K + k, mask=t_ok, other=0) != 0
                    r = tl.load(dst_rank_ptr + t * K + k, mask=t_ok, other=0).to(tl.int64)
                    row = tl.load(dst_row_ptr + t * K + k, mask=t_ok, other=0).to(tl.int64)
                    copy_k = tl.load(copy_row_ptr + t * K + k, mask=t_ok, other=0).to(tl.int64)
                    put = sent | ((r == rank) & (copy_k != row))
                    dst = r * recv_rank_stride + row * recv_row_stride
                    tl.store(recv_ptr + dst[:, None] + hh[None, :], tile, mask=m & put[:, None])
        tb = tl.atomic_add(work_ptr, 1)
    if FENCE:
        _fence_sys(kk)  # this thread's peer stores performed at system scope before the program ends
    if tl.atomic_add(work_ptr + 1, 1) == num_programs - 1:
        tl.atomic_xchg(work_ptr, 0)
        tl.atomic_xchg(work_ptr + 1, 0)


@triton.jit
def _expand_kernel(recv_ptr, row_weight_ptr, row_link_ptr, offs_ptr, sizes_ptr,
                   nvs_s, H, recv_row_stride, G, zero_row, pad, src_base, SK,
                   LOG_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, COPY: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < nvs_s
    # g = searchsorted(offs, r, right=True): the first group whose padded end lies past r
    lo = tl.zeros([BLOCK_R], dtype=tl.int32)
    hi = tl.zeros([BLOCK_R], dtype=tl.int32) + G
    for _ in tl.static_range(LOG_G):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(offs_ptr + mid, mask=active, other=0)
        right = v <= r
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (v > r), mid, hi)
    g = tl.minimum(lo, G - 1)
    end = tl.load(offs_ptr + g)
    size = tl.load(sizes_ptr + g)
    padded = (size + pad - 1) // pad * pad
    last = tl.load(offs_ptr + G - 1)
    is_row = r_ok & (r < last) & (r - (end - padded) < size)
    is_pad = r_ok & ((r >= last) | (r - (end - padded) >= size))
    tl.store(row_link_ptr + 2 * r + 1, tl.zeros([BLOCK_R], dtype=tl.int32) - 1, mask=is_pad)  # row_src
    if COPY:
        tl.store(row_link_ptr + 2 * r, tl.zeros([BLOCK_R], dtype=tl.int32) + zero_row, mask=is_pad)  # row_copy
        tl.store(row_weight_ptr + r, tl.zeros([BLOCK_R], dtype=tl.float32), mask=is_pad)
        src = tl.load(row_link_ptr + 2 * r, mask=is_row, other=0)  # row_copy
        # a duplicate from this rank's own tokens (row_src in [src_base, src_base + SK)) was stored by
        # this rank's scatter, earlier on the same stream: only peers' duplicates are copied here
        source = tl.load(row_link_ptr + 2 * r + 1, mask=is_row, other=0)  # row_src
        own = (source >= src_base) & (source < src_base + SK)
        dup = is_row & (src != r) & ~own
        write = dup | is_pad
        # a block with neither (every block at one rank but the few holding padding rows) skips the row walk
        if tl.sum(write.to(tl.int32), axis=0) > 0:
            src64 = src.to(tl.int64)
            r64 = r.to(tl.int64)
            hh0 = tl.arange(0, BLOCK_H)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + hh0
                h_ok = (hh < H)[None, :]
                tile = tl.load(recv_ptr + src64[:, None] * recv_row_stride + hh[None, :],
                               mask=dup[:, None] & h_ok, other=0.0)
                tl.store(recv_ptr + r64[:, None] * recv_row_stride + hh[None, :], tile,
                         mask=write[:, None] & h_ok)


@triton.jit
def _row_value(y_ptr, add_ptr, w_ptr, r, hh, r_mask, h_ok, y_stride, add_stride,
               HAS_ADD: tl.constexpr, HAS_W: tl.constexpr):
    """fp32 value of rows r: y (+ add) (* w), each step one fp32 operation (the PyTorch path's order)."""
    m = r_mask[:, None] & h_ok
    v = tl.load(y_ptr + r[:, None] * y_stride + hh[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_ADD:
        v = v + tl.load(add_ptr + r[:, None] * add_stride + hh[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_W:
        v = v * tl.load(w_ptr + r, mask=r_mask, other=0.0)[:, None]
    return v


@triton.jit
def _push_kernel(y_ptr, add_ptr, w_ptr, scal_ptr, row_link_ptr, land_ptr, land_scal_ptr,
                 nvs_s, H, y_stride, add_stride, land_rank_stride, land_row_stride, land_scal_rank_stride, SK,
                 num_iters, num_programs, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                 HAS_SCAL: tl.constexpr, HAS_ADD: tl.constexpr, HAS_W: tl.constexpr, FENCE: tl.constexpr):
    pid = tl.program_id(0)
    hh0 = tl.arange(0, BLOCK_H)
    for i in range(0, num_iters):
        rb = pid + i * num_programs
        r = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        r_ok = r < nvs_s
        src = tl.load(row_link_ptr + 2 * r + 1, mask=r_ok, other=-1)  # row_src
        ok = r_ok & (src >= 0)
        src = tl.where(ok, src, 0).to(tl.int64)
        src_rank = src // SK
        entry = src % SK
        if HAS_SCAL:
            scal = tl.load(scal_ptr + r, mask=ok, other=0.0)
            tl.store(land_scal_ptr + src_rank * land_scal_rank_stride + entry, scal, mask=ok)
        dst = src_rank * land_rank_stride + entry * land_row_stride
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + hh0
            h_ok = (hh < H)[None, :]
            m = ok[:, None] & h_ok
            if HAS_ADD or HAS_W:
                tile = _row_value(y_ptr, add_ptr, w_ptr, r, hh, ok, h_ok, y_stride, add_stride, HAS_ADD,
                                  HAS_W).to(land_ptr.dtype.element_ty)
            else:
                tile = tl.load(y_ptr + r[:, None] * y_stride + hh[None, :], mask=m)
            tl.store(land_ptr + dst[:, None] + hh[None, :], tile, mask=m)
    if FENCE:
        _fence_sys(hh0)  # this thread's peer stores performed at system scope before the program ends


@triton.jit
def _chain_list_kernel(row_link_ptr, row_chain_ptr, list_ptr, count_ptr, nvs_s,
                       K: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr):
    """One program per segment of SEG rows: the row lists of the segment's primary rows (chain bit 1,
    row_src >= 0) at the front of the segment's list rows, in row order; -1 in the rest; the count."""
    seg = tl.program_id(0)
    i = tl.arange(0, SEG)
    r = seg * SEG + i
    r_ok = r < nvs_s
    src = tl.load(row_link_ptr + 2 * r + 1, mask=r_ok, other=-1)  # row_src
    ok = r_ok & (src >= 0)
    chain = tl.load(row_chain_ptr + r, mask=ok, other=0)
    first = ok & ((chain & 1) != 0)
    kk = tl.arange(0, BLOCK_K)
    lst = tl.where(kk[None, :] == 0, r[:, None], -1)  # j = 0: the primary row itself
    nxt = chain >> 1
    for j in tl.static_range(1, K):  # the dependent steps, on int32 indices only
        act = first & (nxt >= 0)
        lst = tl.where((kk[None, :] == j) & act[:, None], nxt[:, None], lst)
        nxt = tl.where(act, tl.load(row_chain_ptr + nxt, mask=act, other=-2) >> 1, -1)
    slot = tl.cumsum(first.to(tl.int32), axis=0) - 1  # the primary's position among the segment's primaries
    count = tl.sum(first.to(tl.int32), axis=0)
    k_ok = (kk < K)[None, :]
    tl.store(list_ptr + (seg * SEG + slot)[:, None] * K + kk[None, :], lst, mask=first[:, None] & k_ok)
    tl.store(list_ptr + r[:, None] * K + kk[None, :], tl.full([SEG, BLOCK_K], -1, tl.int32),
             mask=(r_ok & (i >= count))[:, None] & k_ok)
    tl.store(count_ptr + seg, count)


@triton.jit
def _push_reduce_kernel(y_ptr, add_ptr, w_ptr, scal_ptr, row_link_ptr, list_ptr, count_ptr, land_ptr, land_scal_ptr,
                        num_segs, H, y_stride, add_stride, land_rank_stride, land_row_stride, land_scal_rank_stride,
                        SK, num_programs, K: tl.constexpr, SEG: tl.constexpr, MAX_SEGS: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SCAL: tl.constexpr, HAS_ADD: tl.constexpr,
                        HAS_W: tl.constexpr, FENCE: tl.constexpr):
    pid = tl.program_id(0)
    hh0 = tl.arange(0, BLOCK_H)
    ss = tl.arange(0, MAX_SEGS)
    max_count = tl.max(tl.load(count_ptr + ss, mask=ss < num_segs, other=0), axis=0)
    # block b: list positions q .. q + BLOCK_P of segment b % num_segs, q = (b // num_segs) * BLOCK_P; every
    # segment's first block comes before any second block, so the non-empty blocks are the first ones
    # and spread over all programs; the loop ends past the fullest segment.
    b = pid
    q = (b // num_segs) * BLOCK_P
    while q < max_count:
        seg = b % num_segs
        i = q + tl.arange(0, BLOCK_P)
        pv = i < tl.load(count_ptr + seg)
        p = (seg * SEG + i).to(tl.int64)
        r0 = tl.load(list_ptr + p * K, mask=pv, other=0).to(tl.int64)  # the primary rows
        src = tl.load(row_link_ptr + 2 * r0 + 1, mask=pv, other=0).to(tl.int64)
        dst = (src // SK) * land_rank_stride + (src % SK) * land_row_stride
        if HAS_SCAL:  # every row's scalar into its own entry's slot
            for j in tl.static_range(K):
                row_j = tl.load(list_ptr + p * K + j, mask=pv, other=-1).to(tl.int64)
                act_j = row_j >= 0
                row_j = tl.where(act_j, row_j, 0)
                src_j = tl.load(row_link_ptr + 2 * row_j + 1, mask=act_j, other=0).to(tl.int64)
                scal = tl.load(scal_ptr + row_j, mask=act_j, other=0.0)
                tl.store(land_scal_ptr + (src_j // SK) * land_scal_rank_stride + src_j % SK, scal, mask=act_j)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + hh0
            h_ok = (hh < H)[None, :]
            # the K rows' loads are independent of each other; the sum keeps ascending k, one fp32 add each
            acc = _row_value(y_ptr, add_ptr, w_ptr, r0, hh, pv, h_ok, y_stride, add_stride, HAS_ADD, HAS_W)
            for j in tl.static_range(1, K):
                row = tl.load(list_ptr + p * K + j, mask=pv, other=-1).to(tl.int64)
                act = row >= 0
                v = _row_value(y_ptr, add_ptr, w_ptr, tl.where(act, row, 0), hh, act, h_ok, y_stride, add_stride,
                               HAS_ADD, HAS_W)
                acc = tl.where(act[:, None], acc + v, acc)
            tl.store(land_ptr + dst[:, None] + hh[None, :], acc.to(land_ptr.dtype.element_ty), mask=pv[:, None] & h_ok)
        b += num_programs
        q = (b // num_segs) * BLOCK_P
    if FENCE:
        _fence_sys(hh0)  # this thread's peer stores performed at system scope before the program ends


@triton.jit
def _reduce_kernel(land_ptr, sent_ptr, out_ptr, s, H, land_row_stride, out_stride,
                   K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, FIRST_ONLY: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < s
    m = t_ok[:, None] & (hh < H)[None, :]
    first = land_ptr + (t * K)[:, None] * land_row_stride + hh[None, :]
    if FIRST_ONLY:  # the partial rows: landing rows of each token's first entry per rank (sent_sK), only those read
        have = tl.load(sent_ptr + t * K, mask=t_ok, other=0) != 0
        acc = tl.load(first, mask=m & have[:, None], other=0.0).to(tl.float32)
        for k in tl.static_range(1, K):  # ascending k, the first partial taken as is, then one fp32 add each
            p = tl.load(sent_ptr + t * K + k, mask=t_ok, other=0) != 0
            v = tl.load(first + k * land_row_stride, mask=m & p[:, None], other=0.0).to(tl.float32)
            acc = tl.where((p & have)[:, None], acc + v, tl.where(p[:, None], v, acc))
            have = have | p
    else:
        acc = tl.load(first, mask=m, other=0.0).to(tl.float32)
        for k in tl.static_range(1, K):  # ascending k, one fp32 add each: the PyTorch path's order
            acc += tl.load(first + k * land_row_stride, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * out_stride + hh[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------- launches

def _fences(t: torch.Tensor) -> bool:
    """The system-scope fence is PTX: on the GPU only (Triton's interpreter runs the CPU tests)."""
    return t.is_cuda


def scatter_work(device: torch.device) -> torch.Tensor:
    """The scatter's block counter and exit counter, zero; each launch leaves them zero."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def scatter(x_sH: torch.Tensor, weights_sK: torch.Tensor | None, dst_rank_sK: torch.Tensor,
            dst_row_sK: torch.Tensor, copy_row_sK: torch.Tensor, sent_sK: torch.Tensor,
            recv_all: torch.Tensor, row_weight_all: torch.Tensor, row_link_all: torch.Tensor,
            row_chain_all: torch.Tensor | None, src_base: int, rank: int, grid: int, work: torch.Tensor, *,
            tile: int = _TILE, rows: bool = True) -> None:
    """Sender side of dispatch: entry metadata to every destination row (row_link_all [R, rows, 2]:
    (row_copy, row_src) records, row_src = src_base + t * K + k; row_chain_all [R, rows] the chain
    links of combine_reduce "destination", None: not written), token rows once per destination rank
    and into each duplicate row on `rank` (this rank: expand with the same src_base copies none of
    them) (rows=False: row_src and the chain only, for combine's refresh). `tile`: elements of x per
    program step (BufferOptions.scatter_tile);
    `grid`: programs at most (BufferOptions.num_sms). `work`: int32 [2], zero before the launch and zero again after it (the
    block counter; see scatter_work); launches that share it must be ordered (one stream): two
    overlapping launches would split each other's blocks, and nothing detects it (a Buffer orders its
    calls on one stream at a time, moonep.comm_stream)."""
    s, K = dst_rank_sK.shape
    H = recv_all.shape[-1]
    assert row_link_all.shape[-1] == 2 and row_link_all.stride(-1) == 1 and row_link_all.stride(1) == 2
    link64 = row_link_all.view(torch.int64)  # [R, rows, 1]: one 8-byte record per row
    w = weights_sK if weights_sK is not None else row_weight_all  # never read when HAS_W is off
    chain = row_chain_all if row_chain_all is not None else row_weight_all  # never touched when CHAIN is off
    assert row_chain_all is None or row_chain_all.stride(0) == row_weight_all.stride(0)  # one `meta` offset
    block_t, block_h = _tile(H, tile)
    num_blocks = triton.cdiv(s, block_t)
    programs = max(1, min(grid, num_blocks))
    _scatter_kernel[(programs,)](
        x_sH, w, dst_rank_sK, dst_row_sK, copy_row_sK, sent_sK.view(torch.uint8),
        recv_all, row_weight_all, row_link_all, link64, chain,
        s, H, x_sH.stride(0), recv_all.stride(0), recv_all.stride(1), row_weight_all.stride(0), link64.stride(0),
        src_base, rank, work, programs, K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_T=block_t, BLOCK_H=block_h,
        HAS_W=weights_sK is not None, ROWS=rows, CHAIN=row_chain_all is not None, FENCE=_fences(x_sH),
        num_warps=_NUM_WARPS)


def expand(recv: torch.Tensor, row_weight: torch.Tensor, row_link: torch.Tensor,
           offs_G: torch.Tensor, sizes_G: torch.Tensor, nvs_s: int, zero_row: int, token_padding: int,
           src_base: int, entries_per_rank: int, *, copy: bool = True) -> None:
    """Receiver side of dispatch: mark and zero padding rows, copy duplicates from their primary row,
    except those of this rank's own tokens (row_src in [src_base, src_base + entries_per_rank), the
    scatter's src_base on this rank: its scatter stored them) (copy=False: only row_src = -1 on padding
    rows, for combine's refresh)."""
    assert row_link.shape[-1] == 2 and row_link.is_contiguous()
    G = offs_G.numel()
    H = recv.shape[-1]
    block_h = min(triton.next_power_of_2(H), _EXPAND_MAX_H)
    block_r = _TILE // block_h
    _expand_kernel[(triton.cdiv(nvs_s, block_r),)](
        recv, row_weight, row_link, offs_G, sizes_G, nvs_s, H, recv.stride(0), G, zero_row,
        token_padding, src_base, entries_per_rank, LOG_G=G.bit_length(), BLOCK_R=block_r, BLOCK_H=block_h,
        COPY=copy, num_warps=_NUM_WARPS)


def chain_scratch(rows: int, topk: int, device: torch.device, *, segment: int = _SEGMENT
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local scratch of the combine_reduce "destination" push for up to `rows` receive rows: the row
    lists int32 [rows, topk] and the primary count per segment of `segment` rows, int32 [segments]."""
    return (torch.empty(rows, topk, dtype=torch.int32, device=device),
            torch.empty(max(1, triton.cdiv(rows, segment)), dtype=torch.int32, device=device))


def chain_lists(row_link: torch.Tensor, row_chain: torch.Tensor, nvs_s: int, row_list: torch.Tensor,
                count: torch.Tensor, *, segment: int = _SEGMENT) -> None:
    """The chains of rows [0, nvs_s) resolved (combine_reduce "destination"): segment g's primary
    rows (row_src >= 0, chain bit 1) in row order take list rows g * segment + 0, 1, ..., each
    row_list[., j] = the row of the token's j-th entry here (ascending k; j = 0 the primary itself),
    -1 past the chain's end; count[g] = their number; the segment's other list rows below nvs_s hold -1."""
    K = row_list.shape[1]
    assert row_link.shape[-1] == 2 and row_link.is_contiguous() and row_list.is_contiguous()
    assert row_list.shape[0] >= nvs_s and count.numel() >= triton.cdiv(nvs_s, segment)
    _chain_list_kernel[(max(1, triton.cdiv(nvs_s, segment)),)](
        row_link, row_chain, row_list, count, nvs_s, K=K, BLOCK_K=triton.next_power_of_2(K), SEG=segment,
        num_warps=8)


def push(y_rows: torch.Tensor, row_scalars: torch.Tensor | None, row_link: torch.Tensor, nvs_s: int,
         land_all: torch.Tensor, land_scalar_all: torch.Tensor, entries_per_rank: int, grid: int, *,
         row_chain: torch.Tensor | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
         row_weights: torch.Tensor | None = None, add_rows: torch.Tensor | None = None,
         reduce_tile: int = _REDUCE_PUSH_TILE, segment: int = _SEGMENT) -> None:
    """Destination side of combine: every valid row into its source's landing row; with `row_chain`
    (combine_reduce "destination"; `scratch` from chain_scratch, its lists' width K) one row per
    (source rank, token): the fp32 sum over the token's rows here in ascending k, in the landing row
    of its first entry (chain_lists, then the reduce push). A row's value is y (+ add_rows)
    (* row_weights) in fp32 (rounded once per landing row); without either, y's bits. `reduce_tile`
    (elements per program step) and `segment` shape the reduce push's blocks (tests use small ones).

    The reduce push's blocks are list rows x hidden (4 x 512 by default): block b takes segment
    b % segments, every segment's first block before any second one, so the non-empty blocks come
    first and spread over the programs, and a program stops past the fullest segment. A list row's K
    rows load independently (the K - 1 dependent steps of a chain walk int32 indices, in chain_lists)."""
    assert row_link.shape[-1] == 2 and row_link.is_contiguous()
    H = y_rows.shape[-1]
    scal = row_scalars if row_scalars is not None else land_scalar_all  # never read when HAS_SCAL is off
    add = add_rows if add_rows is not None else y_rows  # never read when HAS_ADD is off
    w = row_weights if row_weights is not None else land_scalar_all  # never read when HAS_W is off
    strides = (y_rows.stride(0), add.stride(0), land_all.stride(0), land_all.stride(1), land_scalar_all.stride(0),
               entries_per_rank)
    flags = dict(HAS_SCAL=row_scalars is not None, HAS_ADD=add_rows is not None, HAS_W=row_weights is not None,
                 FENCE=_fences(y_rows),
                 enable_fp_fusion=False)  # acc + y * w stays two roundings, as in the PyTorch path (no FMA)
    if row_chain is None:
        block_r, block_h = _tile(H)
        num_blocks = triton.cdiv(nvs_s, block_r)
        programs = max(1, min(grid, num_blocks))
        _push_kernel[(programs,)](
            y_rows, add, w, scal, row_link, land_all, land_scalar_all, nvs_s, H, *strides,
            triton.cdiv(num_blocks, programs), programs, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_NUM_WARPS,
            **flags)
        return
    assert scratch is not None, "the destination reduce needs chain_scratch's lists"
    row_list, count = scratch
    chain_lists(row_link, row_chain, nvs_s, row_list, count, segment=segment)
    block_p, block_h = _reduce_push_block(H, reduce_tile)
    assert segment % block_p == 0
    num_segs = max(1, triton.cdiv(nvs_s, segment))
    programs = max(1, min(grid * _REDUCE_PUSH_PER_SM, num_segs * (segment // block_p)))
    _push_reduce_kernel[(programs,)](
        y_rows, add, w, scal, row_link, row_list, count, land_all, land_scalar_all, num_segs, H, *strides,
        programs, K=row_list.shape[1], SEG=segment, MAX_SEGS=triton.next_power_of_2(count.numel()),
        BLOCK_P=block_p, BLOCK_H=block_h, num_warps=_REDUCE_PUSH_WARPS, **flags)


def reduce(land: torch.Tensor, out_sH: torch.Tensor, topk: int, sent_sK: torch.Tensor | None = None) -> None:
    """Source side of combine: out[t] = sum over k of land[t*K + k], fp32, ascending k; with `sent_sK`
    (combine_reduce "destination") over the k with sent_sK[t, k] only (the partial rows)."""
    s, H = out_sH.shape
    sent = sent_sK.view(torch.uint8) if sent_sK is not None else land  # never read when FIRST_ONLY is off
    _reduce_kernel[(triton.cdiv(s, _REDUCE_BLOCK_T), triton.cdiv(H, _REDUCE_BLOCK_H))](
        land, sent, out_sH, s, H, land.stride(0), out_sH.stride(0), K=topk, BLOCK_T=_REDUCE_BLOCK_T,
        BLOCK_H=_REDUCE_BLOCK_H, FIRST_ONLY=sent_sK is not None, num_warps=_REDUCE_WARPS)
