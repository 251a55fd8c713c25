# The fused planner with one shared program (moonep.planner.fused at commit 5845eed), kept only so that
# benchmarks/bench_planner.py --baseline times it next to the library's planner in the same run.
# Delete this folder (and --baseline) once the K3 planner numbers are recorded.
"""The fused planner: the whole of SPEC 5 in four Triton launches around the histogram barrier,
bitwise equal to `moonep.planner.reference.make_plan` (the specification) on every field of the Plan.
Buffers on the triton path plan with it.

Protocol of one plan (every rank; s tokens, K top-k, flat entry index i = t*K + k):
    1. `_chunk_kernel`, one program per chunk of CHUNK consecutive flat entries: the chunk's
       expert histogram, and each entry's rank among the chunk's entries of the same expert in flat
       order (tl.sort on the key expert*CHUNK + i, then a scan over runs of equal experts). Then
       `_prefix_kernel`, one program per 16 experts, turns the per-chunk histograms into exclusive
       prefixes over chunks and writes the local histogram (their sum) into row `rank` of every
       peer's hist region (plain peer stores).
    2. the heap barrier "dispatch:histograms" (moonep.heap.device_barrier on CUDA: its
       fence.sc.sys + st.release.sys / ld.acquire.sys and stream order make the peer stores of 1
       visible to 3 and 4 on every rank).
    3. `_shared_kernel`, one program: counts_RE (copied out of the own hist region), receive caps,
       receiver filling, quota split, slots, group rows and offs (SPEC 5.1-5.4 with the
       specification's tie rules: tl.argmax / tl.argmin keep the lowest index, as torch does),
       plus per (expert e, rank d) the end of d's share of e's entry list and the receive row of
       e's entry number 0 on d, so that step 4 needs two lookups per entry. The quota-split loop
       stops once every quota is 0 (the specification's remaining masked steps move 0 tokens).
    4. `_dest_kernel`, one program per BLOCK_T whole tokens: SPEC 5.5 for this rank's entries,
       pos = (tokens of e on lower ranks) + (e's entries in earlier chunks) + (rank inside the
       chunk); dst_rank = number of ranks whose share of e ends at or before pos; dst_row = the
       row of e's entry 0 on dst + pos; dedup over the token's K entries in registers.
All outputs of a plan live in one flat byte buffer (int64 fields, then int32, then bool) that
`_PlanLayout` cuts into the Plan's tensors.

The shared kernel holds the whole problem in registers as small tiles: R ranks (padded to a power
of two R_P), epn experts per home group (EPN_P), G = E + B groups (G_P). Padded lanes: quota and
remaining get -1 in padded columns so argmax never picks them, 0 in padded rows so their `take` is
0; balance gets the dtype's extreme values for argmax/argmin.

On CUDA the four launches of one shape are captured in CUDA graphs, each writing into its own
pooled Plan (`_PlanPool`); a call copies topk into the graphs' input and replays a graph whose Plan
nothing outside the pool holds any more (no Python reference to the Plan or its tensors, no
autograd save, no view), capturing a new one when every pooled Plan is held. A plan thus outlives
later calls (it is saved for backward) at the cost of one copy and one replay. The pool's contract
is the caching allocator's without record_stream: work on another stream that reads a Plan must be
joined to the calling stream before the Plan is dropped (moonep's side-stream prefetch is). The
pool keeps as many Plans per shape as were ever held at once (1.1 MB each at s = 8192, K = 8).
While the caller's stream is being captured (a training step inside a CUDA graph) and on the CPU
heap (the interpreter), the kernels launch directly into a fresh output buffer. No path
synchronises with the host; the first call of a shape compiles and captures (host syncs, like any
compile step).

The histogram is counted from topk_sK on the device: the tokens_per_expert_E argument must equal
it (SPEC 8; `BufferOptions.check_values` verifies it) and is not read on this path.

Why Triton: Triton's interpreter runs these kernels on the CPU, so CI checks them bitwise against
the PyTorch planner (tests/moonep/test_kernels_interpreted.py, R = 1..8 simulated in one process
plus a 2-rank Buffer on the CPU heap) before any device time is spent.

Race note (as on the PyTorch path): the hist region is single-buffered. A peer may write its next
histogram only after a barrier that follows this rank's step 3; Buffer.plan passes barrier
"plan:enter" first when two plans follow each other with nothing collective in between.

Measured (2xH200 NV18, torch 2.11, 2026-11-29/30; R=2, S=8192, K=8):
- kernels alone (benchmarks/bench_planner.py, E=384, every rank simulated on one GPU, one CUDA graph
  replay, median of 50): chunk 512 x 4 warps 25.6 us, of which the chunk pass (with the prefix
  launch) 17.2 us and the shared + destination pass 17.5 us (the parts overlap a little in one
  graph). Other chunks: 1024 x 4 29.6, 256 x 4 27.8, 2048 x 4 49.2, 2048 x 8 40.2 us.
- Buffer.plan on 2 GPUs (benchmarks/bench_comm.py), with the barrier: 29-32 us of GPU time per plan
  in a run of 8 at E=96 and E=384; one call alone, host launch and the ranks' host skew included,
  54-122 us.

Rejected: the prefixes over chunks in the last chunk program to finish (a ticket counter; 36.2 us
at chunk 512); counting ranks with a [CHUNK, E] one-hot cumsum (E times more work and registers
than the sort); a single persistent kernel with an in-kernel grid barrier (needs all programs
co-resident and spins inside the interpreter's sequential programs); launching eagerly on CUDA (3
Triton launches + the barrier cost the host ~100 us); the PyTorch planner replayed from a CUDA
graph (~400 small kernels per plan); a CuTe DSL kernel of the shared part (experiments/cute_planner).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moonep.layout import Layout
from moonep.planner.plan import Plan

CHUNK = 512  # flat entries per histogram program (a power of two for tl.sort); benchmarks/bench_planner.py sweeps it
_DEST_ENTRIES = 1024  # entries per destination program (whole tokens, K padded to a power of two)
_PREFIX_EXPERTS = 16  # experts per program of the prefix kernel
_DEDUP_TILE = 8192  # elements of the destination program's [tokens, K_P, K_P] dedup tile (registers)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _indicator(N_DIMS: tl.constexpr, i: tl.constexpr):
    # 0/1 coordinate along the i-th innermost axis of the [2] * N_DIMS hypercube
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - i - 1) + [2] + [1] * i)


@triton.jit
def _compare_and_swap(h, flip, i: tl.constexpr, N_DIMS: tl.constexpr):
    # triton.language.standard's bitonic step, with the partner found by a sum over the pair instead
    # of an xor reduction (same cost on the GPU; numpy-fast in the interpreter)
    partner = tl.sum(h, axis=N_DIMS - 1 - i, keep_dims=True) - h
    return tl.where((h > partner) != (flip ^ _indicator(N_DIMS, i)), partner, h)


@triton.jit
def _sort(x, LOG_N: tl.constexpr):
    """Ascending bitonic sort of a 1-D block of 2**LOG_N distinct int32 keys < 2**30."""
    h = tl.reshape(x, [2] * LOG_N)
    for stage in tl.static_range(1, LOG_N + 1):
        if stage < LOG_N:
            flip = _indicator(LOG_N, stage)  # alternating runs: bitonic sequences for the next stage
        else:
            flip = 0
        for i in tl.static_range(stage):
            h = _compare_and_swap(h, flip, stage - 1 - i, LOG_N)
    return tl.reshape(h, x.shape)


@triton.jit
def _chunk_kernel(topk_ptr, rank_ptr, chunk_hist_ptr, num_entries, E,
                  CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr, E_BINS: tl.constexpr):
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    entry = c * CHUNK + i
    ok = entry < num_entries
    expert = tl.load(topk_ptr + entry, mask=ok, other=E).to(tl.int32)  # padding sorts last, bin E
    counts = tl.histogram(expert, E_BINS)
    bins = tl.arange(0, E_BINS)
    tl.store(chunk_hist_ptr + c * E + bins, counts, mask=bins < E)
    # sorted by (expert, i): an entry's rank among its expert's entries is its sorted position minus
    # the position of the expert's first entry (the exclusive cumulative histogram)
    key = _sort(expert * CHUNK + i, LOG_CHUNK)
    run_start = tl.gather(tl.cumsum(counts, axis=0) - counts, key >> LOG_CHUNK, 0)
    idx = c * CHUNK + (key & (CHUNK - 1))
    tl.store(rank_ptr + idx, i - run_start, mask=idx < num_entries)


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


@triton.jit(do_not_specialize=["rank", "cap_base", "cap_rem"])
def _shared_kernel(hist_ptr, counts_ptr, cap_ptr, quota_ptr, alloc_ptr, slot_ptr, rows_ptr, offs_ptr,
                   base_ptr, end_ptr, rowbase_ptr, rank, cap_base, cap_rem,
                   R: tl.constexpr, EPN: tl.constexpr, B: tl.constexpr, PAD: tl.constexpr,
                   R_P: tl.constexpr, EPN_P: tl.constexpr, G_P: tl.constexpr, B_P: tl.constexpr):
    E: tl.constexpr = R * EPN
    G: tl.constexpr = E + B
    BIG: tl.constexpr = 2**30
    h_R = tl.arange(0, R_P)
    i_I = tl.arange(0, EPN_P)
    ok_R = h_R < R
    ok_HI = (h_R[:, None] < R) & (i_I[None, :] < EPN)
    e_HI = h_R[:, None] * EPN + i_I[None, :]
    # 1. counts (copied out), tokens per expert, tokens of each expert on ranks below this one
    count_HI = tl.zeros([R_P, EPN_P], dtype=tl.int32)
    base_HI = tl.zeros([R_P, EPN_P], dtype=tl.int32)
    for r in tl.static_range(R):
        c_HI = tl.load(hist_ptr + r * E + e_HI, mask=ok_HI, other=0)
        tl.store(counts_ptr + r * E + e_HI, c_HI, mask=ok_HI)
        count_HI += c_HI
        base_HI += tl.where(r < rank, c_HI, 0)
    tl.store(base_ptr + e_HI, base_HI, mask=ok_HI)
    group_R = tl.sum(count_HI, axis=1)
    cap_R = cap_base + (h_R < cap_rem).to(tl.int32)
    tl.store(cap_ptr + h_R, cap_R.to(tl.int64), mask=ok_R)
    bal = group_R - cap_R
    # 2. receiver filling (SPEC 5.2)
    d_RR = tl.arange(0, R_P)[None, :]
    hrow_RR = h_R[:, None]
    quota = tl.zeros([R_P, R_P], dtype=tl.int32)
    for _ in tl.static_range(R - 1):
        h = tl.argmax(tl.where(ok_R, bal, -BIG), axis=0)
        u = tl.argmin(tl.where(ok_R, bal, BIG), axis=0)
        bal_h = tl.sum(tl.where(h_R == h, bal, 0), axis=0)
        bal_u = tl.sum(tl.where(h_R == u, bal, 0), axis=0)
        active = bal_h > 0
        quota += tl.where((hrow_RR == h) & (d_RR == u) & active, -bal_u, 0)
        new_h = bal_h + tl.where(active, bal_u, 0)
        new_u = tl.where(active, 0, bal_u)
        bal = tl.where(h_R == u, new_u, bal)
        bal = tl.where(h_R == h, new_h, bal)
    tl.store(quota_ptr + hrow_RR * R + d_RR, quota.to(tl.int64), mask=(hrow_RR < R) & (d_RR < R))
    # 3. quota -> experts (SPEC 5.3), all donors at once, until every quota is closed
    q_tile = tl.where(d_RR < R, quota, -1)
    q_tile = tl.where(hrow_RR < R, q_tile, 0)
    m_tile = tl.where(i_I[None, :] < EPN, count_HI, -1)
    m_tile = tl.where(h_R[:, None] < R, m_tile, 0)
    i_3 = i_I[None, :, None]
    d_3 = tl.arange(0, R_P)[None, None, :]
    alloc = tl.zeros([R_P, EPN_P, R_P], dtype=tl.int32)
    step = 0
    open_quota = tl.max(tl.max(q_tile, axis=1), axis=0)
    while (step < EPN + R - 1) & (open_quota > 0):
        d = tl.argmax(q_tile, axis=1)  # [R_P]
        q = tl.sum(tl.where(d_RR == d[:, None], q_tile, 0), axis=1)
        le = tl.argmax(m_tile, axis=1)
        rem = tl.sum(tl.where(i_I[None, :] == le[:, None], m_tile, 0), axis=1)
        take = tl.minimum(q, rem)
        q_tile -= tl.where(d_RR == d[:, None], take[:, None], 0)
        m_tile -= tl.where(i_I[None, :] == le[:, None], take[:, None], 0)
        alloc += tl.where((i_3 == le[:, None, None]) & (d_3 == d[:, None, None]), take[:, None, None], 0)
        open_quota = tl.max(tl.max(q_tile, axis=1), axis=0)
        step += 1
    home_rest = tl.where(i_I[None, :] < EPN, m_tile, 0)
    alloc += tl.where(d_3 == h_R[:, None, None], home_rest[:, :, None], 0)
    # 4. slots (SPEC 5.4): remote experts with tokens, ascending expert id per receiving rank
    e_3 = h_R[:, None, None] * EPN + i_3
    ok_3 = (h_R[:, None, None] < R) & (i_3 < EPN) & (d_3 < R)
    remote = ok_3 & (alloc > 0) & (h_R[:, None, None] != d_3)
    remote_flat = tl.reshape(remote.to(tl.int32), [R_P * EPN_P, R_P])
    slot_3 = tl.reshape(tl.cumsum(remote_flat, axis=0) - 1, [R_P, EPN_P, R_P])
    in_slot = remote & (slot_3 < B)
    group_3 = tl.where(in_slot, E + slot_3, e_3)
    tl.store(alloc_ptr + e_3 * R + d_3, alloc, mask=ok_3)
    # empty slots: expert -1 and 0 rows; the CTA barrier orders these stores before the scatter
    j_B = tl.arange(0, B_P)[None, :]
    ok_RB = (hrow_RR < R) & (j_B < B)
    tl.store(slot_ptr + hrow_RR * B + j_B, tl.full([R_P, B_P], -1, tl.int32), mask=ok_RB)
    tl.store(rows_ptr + hrow_RR * G + E + j_B, tl.zeros([R_P, B_P], dtype=tl.int32), mask=ok_RB)
    tl.debug_barrier()
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
    tl.debug_barrier()
    # 6. per (e, d) for the destinations: end of d's share of e's entries, and the receive row of
    #    e's entry 0 if it went to d (group start on d minus the entries of e on lower ranks)
    end_3 = tl.cumsum(alloc, axis=2)
    g_rows = tl.load(rows_ptr + d_3 * G + group_3, mask=ok_3, other=0)
    g_end = tl.load(offs_ptr + d_3 * G + group_3, mask=ok_3, other=0)
    start = g_end - (g_rows + PAD - 1) // PAD * PAD
    tl.store(end_ptr + e_3 * R + d_3, end_3, mask=ok_3)
    tl.store(rowbase_ptr + e_3 * R + d_3, start - (end_3 - alloc), mask=ok_3)


@triton.jit
def _dest_kernel(topk_ptr, rank_ptr, prefix_ptr, base_ptr, end_ptr, rowbase_ptr,
                 dst_rank_ptr, dst_row_ptr, copy_row_ptr, sent_ptr, num_tokens, E, K,
                 R: tl.constexpr, K_P: tl.constexpr,
                 BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    k = tl.arange(0, K_P)[None, :]
    ok = (t < num_tokens) & (k < K)
    entry = t * K + k
    expert = tl.load(topk_ptr + entry, mask=ok, other=0).to(tl.int32)
    pos = (tl.load(base_ptr + expert, mask=ok, other=0)
           + tl.load(prefix_ptr + (entry // CHUNK) * E + expert, mask=ok, other=0)
           + tl.load(rank_ptr + entry, mask=ok, other=0))
    dst = tl.zeros([BLOCK_T, K_P], dtype=tl.int32)
    for d in tl.static_range(R):  # ranks whose share of the expert ends at or before pos
        dst += (tl.load(end_ptr + expert * R + d, mask=ok, other=0) <= pos).to(tl.int32)
    row = tl.load(rowbase_ptr + expert * R + dst, mask=ok & (dst < R), other=0) + pos
    tl.store(dst_rank_ptr + entry, dst, mask=ok)
    tl.store(dst_row_ptr + entry, row, mask=ok)
    # dedup: the lowest k' of the token with the same destination carries the row
    k2 = tl.arange(0, K_P)[None, None, :]
    same = (dst[:, :, None] == dst[:, None, :]) & (k2 < K)
    first = tl.min(tl.where(same, k2, K_P), axis=2)
    copy = tl.sum(tl.where(k2 == first[:, :, None], row[:, None, :], 0), axis=2)
    tl.store(copy_row_ptr + entry, copy, mask=ok)
    tl.store(sent_ptr + entry, (first == k).to(tl.uint8), mask=ok)


# ---------------------------------------------------------------------------------------------- host side
class _PlanLayout:
    """The flat output buffer of one shape (int32 words): int64 fields, then int32, then bool."""

    _I64 = (("cap_R", ("R",)), ("quota_RR", ("R", "R")))
    _I32 = (("counts_RE", ("R", "E")), ("alloc_ER", ("E", "R")), ("slot_expert_RB", ("R", "B")),
            ("group_rows_RG", ("R", "G")), ("offs_RG", ("R", "G")), ("dst_rank_sK", ("s", "K")),
            ("dst_row_sK", ("s", "K")), ("copy_row_sK", ("s", "K")))

    def __init__(self, layout: Layout, rank: int, s: int, total_num_tokens: int | None) -> None:
        R, E, B, K = layout.num_ranks, layout.config.num_experts, layout.num_slots, layout.config.topk
        dims = {"R": R, "E": E, "B": B, "G": E + B, "s": s, "K": K}
        self.static = {"rank": rank, "num_ranks": R, "num_experts": E, "num_slots": B, "topk": K, "num_tokens": s}
        self.static["nvs_s"] = layout.call_rows(s, total_num_tokens)
        # (field, dtype index 0: int64 / 1: int32 / 2: bool, shape, element offset in that dtype)
        self.fields: list[tuple[str, int, tuple[int, ...], int]] = []
        nbytes = 0
        for kind, (specs, size) in enumerate(((self._I64, 8), (self._I32, 4), ((("sent_sK", ("s", "K")),), 1))):
            nbytes = -(-nbytes // size) * size
            for name, dim_names in specs:
                shape = tuple(dims[d] for d in dim_names)
                self.fields.append((name, kind, shape, nbytes // size))
                nbytes += size * shape[0] * shape[1] if len(shape) == 2 else size * shape[0]
        self.nbytes = -(-nbytes // 8) * 8
        self.strides = [(shape[1], 1) if len(shape) == 2 else (1,) for _, _, shape, _ in self.fields]

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes // 4, dtype=torch.int32, device=device)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        typed = (flat.view(torch.int64), flat, flat.view(torch.bool))
        return {name: typed[kind].as_strided(shape, stride, offset)
                for (name, kind, shape, offset), stride in zip(self.fields, self.strides, strict=True)}

    def plan(self, flat: torch.Tensor) -> Plan:
        return Plan(**self.static, **self.views(flat))


class _Workspace:
    """Intermediate buffers of one shape, reused by every call (one plan at a time per buffer)."""

    def __init__(self, layout: Layout, s: int, device: torch.device, chunk: int = CHUNK, chunk_warps: int = 4) -> None:
        R, E, K = layout.num_ranks, layout.config.num_experts, layout.config.topk
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"chunk={chunk} must be a power of two >= 16 (tl.sort's block)")
        self.chunk, self.chunk_warps = chunk, chunk_warps
        self.num_chunks = triton.cdiv(s * K, chunk)
        i32 = {"dtype": torch.int32, "device": device}
        self.rank_in_chunk = torch.empty(s * K, **i32)
        self.chunk_hist = torch.empty(self.num_chunks, E, **i32)  # histograms, then prefixes
        self.base_E = torch.empty(E, **i32)
        self.end_ER = torch.empty(E, R, **i32)
        self.rowbase_ER = torch.empty(E, R, **i32)


def chunk_pass(topk_sK: torch.Tensor, rank: int, hist_all: torch.Tensor, work: _Workspace) -> None:
    """Step 1: chunk ranks and prefixes into `work`; the local histogram into row `rank` of every
    rank's region of hist_all ([R, R, E] int32, region r = hist_all[r], any strides)."""
    R, _, E = hist_all.shape
    C = work.num_chunks
    assert hist_all.stride(2) == 1
    _chunk_kernel[(C,)](topk_sK, work.rank_in_chunk, work.chunk_hist, topk_sK.numel(), E, CHUNK=work.chunk,
                        LOG_CHUNK=work.chunk.bit_length() - 1, E_BINS=triton.next_power_of_2(E + 1),
                        num_warps=work.chunk_warps)
    _prefix_kernel[(triton.cdiv(E, _PREFIX_EXPERTS),)](
        work.chunk_hist, hist_all, C, rank, hist_all.stride(0), hist_all.stride(1), E, R=R,
        BLOCK_C=min(64, triton.next_power_of_2(C)), BLOCK_E=_PREFIX_EXPERTS, num_warps=4)


def plan_pass(topk_sK: torch.Tensor, rank: int, hist_RE: torch.Tensor, work: _Workspace, out: dict[str, torch.Tensor],
              layout: Layout, cap_base: int, cap_rem: int) -> None:
    """Steps 3-4 from this rank's gathered hist region [R, E] into the Plan tensors `out`."""
    R, E, B = layout.num_ranks, layout.config.num_experts, layout.num_slots
    epn, pad = E // R, layout.config.token_padding
    assert hist_RE.is_contiguous()
    _shared_kernel[(1,)](
        hist_RE, out["counts_RE"], out["cap_R"], out["quota_RR"], out["alloc_ER"], out["slot_expert_RB"],
        out["group_rows_RG"], out["offs_RG"], work.base_E, work.end_ER, work.rowbase_ER, rank, cap_base, cap_rem,
        R=R, EPN=epn, B=B, PAD=pad, R_P=triton.next_power_of_2(R), EPN_P=triton.next_power_of_2(epn),
        G_P=triton.next_power_of_2(E + B), B_P=triton.next_power_of_2(B), num_warps=8)
    s, K = topk_sK.shape
    k_p = triton.next_power_of_2(K)
    block_t = max(1, min(_DEST_ENTRIES // k_p, _DEDUP_TILE // (k_p * k_p)))  # large K: fewer tokens
    _dest_kernel[(triton.cdiv(s, block_t),)](
        topk_sK, work.rank_in_chunk, work.chunk_hist, work.base_E, work.end_ER, work.rowbase_ER,
        out["dst_rank_sK"], out["dst_row_sK"], out["copy_row_sK"], out["sent_sK"].view(torch.uint8), s, E, K,
        R=R, K_P=k_p, BLOCK_T=block_t, CHUNK=work.chunk, num_warps=4)


def receive_cap_args(num_ranks: int, topk: int, s: int, total_num_tokens: int | None) -> tuple[int, int]:
    """(base, remainder) with cap_d = base + (d < remainder): SPEC 5.1 as moonep.planner.receive_caps."""
    if total_num_tokens is None:
        return s * topk, 0
    return divmod(total_num_tokens * topk, num_ranks)


class FusedPlanner:
    """Buffer's planner on the triton path: plan(topk_sK) -> Plan, collective (see the module docstring).

    hist_all: the Buffer's [R, R, E] all-ranks view of the hist region; barrier: the heap barrier of
    the histogram exchange; chunk / chunk_warps: entries and warps per program of the chunk pass
    (benchmarks/bench_planner.py sweeps them). CUDA graphs are replayed on CUDA only."""

    def __init__(self, layout: Layout, rank: int, hist_all: torch.Tensor, barrier: Callable[[], None],
                 chunk: int = CHUNK, chunk_warps: int = 4) -> None:
        self.layout = layout
        self.chunk, self.chunk_warps = chunk, chunk_warps
        self.rank = rank
        self.hist_all = hist_all
        self.barrier = barrier
        self.graph = hist_all.device.type == "cuda"
        self._work: dict[int, _Workspace] = {}
        self._layouts: dict[tuple[int, int | None], _PlanLayout] = {}
        self._graphs: dict[tuple, _PlanPool] = {}

    def __call__(self, topk_sK: torch.Tensor, total_num_tokens: int | None) -> Plan:
        if self.graph and not torch.cuda.is_current_stream_capturing():
            key = (topk_sK.shape[0], topk_sK.dtype, total_num_tokens)
            pool = self._graphs.get(key)
            if pool is None:
                return self._capture_first(key, topk_sK, total_num_tokens)
            entry = pool.take()
            if entry is None:
                entry = self._capture(pool, total_num_tokens)
            pool.topk_in.copy_(topk_sK)
            entry.graph.replay()
            return entry.plan
        plan_layout = self._plan_layout(topk_sK.shape[0], total_num_tokens)
        flat = plan_layout.empty(topk_sK.device)
        self._launch(topk_sK, plan_layout.views(flat), total_num_tokens)
        return plan_layout.plan(flat)

    def pooled_plans(self) -> int:
        """Plans in the graph pools over all shapes (see _PlanPool)."""
        return sum(len(pool.entries) for pool in self._graphs.values())

    def _plan_layout(self, s: int, total: int | None) -> _PlanLayout:
        key = (s, total)
        if key not in self._layouts:
            self._layouts[key] = _PlanLayout(self.layout, self.rank, s, total)
        return self._layouts[key]

    def _launch(self, topk_sK: torch.Tensor, out: dict[str, torch.Tensor], total: int | None) -> None:
        s = topk_sK.shape[0]
        work = self._work.get(s)
        if work is None:
            work = self._work[s] = _Workspace(self.layout, s, topk_sK.device, self.chunk, self.chunk_warps)
        chunk_pass(topk_sK, self.rank, self.hist_all, work)
        self.barrier()
        cap_base, cap_rem = receive_cap_args(self.layout.num_ranks, self.layout.config.topk, s, total)
        plan_pass(topk_sK, self.rank, self.hist_all[self.rank], work, out, self.layout, cap_base, cap_rem)

    def _capture_first(self, key: tuple, topk_sK: torch.Tensor, total: int | None) -> Plan:
        """First call of a shape: run eagerly (compiles; a real collective plan, returned), then
        capture the first graph of the shape's pool (nothing runs; the barrier's epoch lives on
        the device)."""
        plan_layout = self._plan_layout(topk_sK.shape[0], total)
        flat = plan_layout.empty(topk_sK.device)
        self._launch(topk_sK, plan_layout.views(flat), total)
        pool = self._graphs[key] = _PlanPool(topk_sK.clone(), plan_layout)
        pool.release(self._capture(pool, total))
        return plan_layout.plan(flat)

    def _capture(self, pool: _PlanPool, total: int | None) -> _PooledPlan:
        """A new pool entry: a graph of the plan's launches that writes into the entry's own Plan."""
        flat = pool.layout.empty(pool.topk_in.device)
        out = pool.layout.views(flat)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads/streams of a training step (FSDP, NCCL) may keep working
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._launch(pool.topk_in, out, total)
        del out  # the graph writes into flat's memory; the entry's Plan gets views of its own
        entry = _PooledPlan(graph, flat, pool.layout.plan(flat))
        pool.entries.append(entry)
        return entry


class _PooledPlan:
    """One graph of a pool and the Plan its replay writes (views of `flat`)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, flat: torch.Tensor, plan: Plan) -> None:
        self.graph, self.flat, self.plan = graph, flat, plan
        self.tensors = tuple(v for v in vars(plan).values() if isinstance(v, torch.Tensor))
        self.free_holds = self._holds()  # the pool's own references (nothing else exists yet)

    def _holds(self) -> int:
        """References to the plan's tensors: Python references, C++ references (autograd saves),
        and other tensors on the same storage (views)."""
        return _storage_uses(self.flat) + sum(sys.getrefcount(t) + t._use_count() for t in self.tensors)

    def is_free(self) -> bool:
        """Nothing outside the pool holds the Plan (getrefcount: the attribute and its own
        argument), one of its tensors, or a view of them."""
        return sys.getrefcount(self.plan) <= 2 and self._holds() <= self.free_holds


class _PlanPool:
    """Graphs of one shape whose replays write into pooled Plans, reused once the caller has
    dropped every reference to a Plan and its tensors (so a held plan, e.g. saved for backward, is
    never overwritten). A call then costs one input copy and one replay: no clone, no views."""

    def __init__(self, topk_in: torch.Tensor, layout: _PlanLayout) -> None:
        self.topk_in, self.layout = topk_in, layout
        self.entries: list[_PooledPlan] = []

    def take(self) -> _PooledPlan | None:
        for i, entry in enumerate(self.entries):  # least recently used first: the likeliest free
            if entry.is_free():
                self.entries.append(self.entries.pop(i))
                return entry
        return None

    def release(self, entry: _PooledPlan) -> None:
        """An entry that was captured but not handed out (it stays first in line)."""
        self.entries.remove(entry)
        self.entries.insert(0, entry)


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors share t's storage (views included; the temporary storage object of this
    call is not counted)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1
