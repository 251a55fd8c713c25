"""The fused planner: the whole of SPEC 5 in four Triton launches around the histogram barrier,
bitwise equal to `moonep.planner.reference.make_plan` (the specification) on every field of the Plan.
Buffers on the triton path plan with it. This module is the host side (workspaces, launches, CUDA
graphs); the kernels are in moonep.planner.fused_kernels.

Protocol of one plan (every rank; s tokens, K top-k, flat entry index i = t*K + k):
    1. `_chunk_match_kernel`, one program per chunk of CHUNK consecutive flat entries: the chunk's
       expert histogram, and each entry's rank among the chunk's entries of the same expert in flat
       order, by bit-sliced matching of every entry against the chunk's 32-entry blocks (the
       popcounts give the rank and the expert's count in the chunk; no histogram op, no sort). Then
       `_prefix_kernel`, one program per 8-16 experts (one [256 chunks, experts] tile per step),
       turns the per-chunk histograms into exclusive prefixes over chunks and writes the local
       histogram (their sum) into row `rank` of every peer's hist region (plain peer stores).
    2. the heap barrier "dispatch:histograms" (moonep.heap.device_barrier on CUDA: its
       fence.sc.sys + st.release.sys / ld.acquire.sys and stream order make the peer stores of 1
       visible to 3 and 4 on every rank).
    3. `_shared_kernel`, one program per rank d (SPEC 5.1-5.4 with the specification's tie rules,
       lowest index first): every program sums the gathered histograms and repeats the receiver
       filling (R - 1 steps on [R] vectors), noting row d of the quotas and the step that fills
       receiver d; program d then runs the quota split of its own home group and of its donor h,
       the one group with quota[h, d] > 0 (SPEC 5.2: a rank receives from at most one remote
       group), two interleaved chains that stop once their quotas are closed (the specification's
       remaining masked steps move 0 tokens). That gives every count
       rank d's rows depend on: slots are the donor's experts with tokens on d in ascending id
       (the specification's cumsum over all experts counts no other group on d), group rows and
       offs of rank d are three segments (local experts, the donor's home rows, the slots) whose
       padded cumulative ends are written directly. Program d writes counts_RE[d], the rank-d rows
       of slot_expert / group_rows / offs, alloc of its group's experts, and per (expert e, rank d)
       the end of d's share of e's entry list and the receive row of e's entry number 0 on d, both
       relative to this rank's entries (the tokens of e on lower source ranks taken out), so that
       step 4 needs no per-expert base. Program 0 writes cap_R and quota_RR.
    4. `_dest_kernel`, one program per BLOCK_T whole tokens: SPEC 5.5 for this rank's entries,
       pos = (e's entries in earlier chunks) + (rank inside the chunk); dst_rank = number of ranks
       whose share of e ends at or before pos (the [R] ends of e as one contiguous load); dst_row
       = the row of e's entry 0 on dst + pos; dedup in registers over the same [tokens, K, R] tile:
       per token and rank the lowest k and its row, which every entry on that rank copies (rows of
       distinct entries differ, so the carrier is the entry whose copy row is its own row).
All outputs of a plan live in one flat byte buffer (int64 fields, then int32, then bool) that
`_PlanLayout` cuts into the Plan's tensors.

The shared kernel's tiles are per rank: [epn, R] allocations of two groups, [R, R] quotas, [G]
rows of one rank (R padded to a power of two R_P, epn to EPN_P, G = E + B to G_P). An argmax is one
max-reduction of a key (value in the high bits, the index's complement in the low bits; int32 where
R * max_tokens * K leaves room for the index bits, else int64); padded lanes never win (quota and
remaining -1, balance masked). Reductions and scans that can run together are one tl.reduce /
tl.associative_scan of several operands (both chains' argmaxes in a quota-split step, the row
groups' scans and sums): one exchange between warps instead of one each.

On CUDA the four launches of one shape are captured in CUDA graphs, each writing into its own
pooled Plan (`PlanPool`); a call copies topk into the graphs' input and replays a graph whose Plan
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

Measured (H200, 2026-12-01, E=896, K=16, R=8 simulated, S=8192, maxvio 1, chunk 512 x 4 warps,
shared kernel at 2 warps; benchmarks/bench_planner.py --experts 896 --topk 16 --ranks 8): 26.2 us
per idle CUDA-graph replay of the four kernels, 21.5 us per replay of 20 back to back (target
<= 35 us; a graph of one tiny kernel takes 16.9 us, 5.3 us back to back, on that machine); 26.6 /
21.5 us again on another H200, where torch.profiler read the kernels as chunk 4.4, prefix 2.5, shared
6.7 and destination 5.5 us, 0.13 us between them (benchmarks/profile_planner.py). Chunk
512 x 8 warps and 256 x 2-4 warps are within 1-2 us of it, 128 x 4 warps is 9 us slower. Static sm90
code (Triton 3.5 + ptxas, same shape): the chunk kernel 1.7k instructions per program at chunk 512
x 4 warps (0.8k LOP3, 64 POPC, 160 uniform loads of planes, 4 CTA barriers); the shared kernel 3.3k
instructions and 29 CTA barriers per program at 2 warps, 3 per quota-split step (5 steps at maxvio
1); the destination kernel 1.8k instructions, 192 shuffles per 32 tokens.

Rejected (same run and shape as Measured unless stated): a chunk kernel that sorts the chunk
(tl.histogram, a bitonic sort on expert * CHUNK + i, a scan over runs of equal experts; 2.0k sm90
instructions per program with 208 shuffles and 27 CTA barriers): 36.3 us per replay, 30.9 us back to
back; a chunk kernel counting each entry's rank by blocked [64, 64] comparisons with the earlier
entries after a tl.histogram (7.1k instructions per program): 42.6 us, 37.5 us back to back at chunk
512 x 8 warps; the prefixes over chunks in the last chunk program to finish (a ticket counter; 36.2
us at chunk 512, another run); counting ranks with a [CHUNK, E] one-hot cumsum (E times more work
and registers than a sort); the shared kernel at 1 warp (it spills: 42.0 us against 36.3 at 2 warps,
both with the sorting chunk kernel); a single persistent kernel with an in-kernel grid barrier
(needs all programs co-resident and spins inside the interpreter's sequential programs); launching
eagerly on CUDA (3 Triton launches + the barrier cost the host ~100 us); the PyTorch planner
replayed from a CUDA graph (~400 small kernels per plan); a CuTe DSL kernel of the shared part
(experiments/cute_planner); one shared program holding the whole [R, epn, R] problem (7.4k
instructions and 139 barriers at E=896, R=8; its shared + destination pass took 34 us at R=8 against
17 us at R=2 on an H200); the dedup over [tokens, K, K] pairs (twice the tile of [tokens, K, R] at
K=16, R=8, its reductions across lanes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from moonep.layout import Layout
from moonep.planner.fused_kernels import _chunk_match_kernel, _dest_kernel, _prefix_kernel, _shared_kernel
from moonep.planner.plan import Plan
from moonep.planner.plan_pool import PlanPool, PooledPlan

CHUNK = 512  # flat entries per chunk program (a power of two >= 32: whole 32-entry blocks); bench_planner sweeps it
_DEST_ENTRIES = 1024  # entries per destination program (whole tokens, K padded to a power of two)
_PREFIX_CHUNKS = 1024  # chunks per tile of the prefix kernel: s*K = 131072 entries in one step at chunk >= 128
_PREFIX_TILE = 2048  # elements of a prefix tile ([chunks, experts]; at most 16 experts per program)
_SHARED_WARPS = 2  # warps per program of the shared pass (2 was faster than 4 and 8 at K3's shape; 1 spills)
_DEST_TILE = 4096  # elements of the destination program's [tokens, K_P, R_P] tile (registers)


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
    """Intermediate buffers of one shape, reused by every call (one plan at a time per buffer).

    chunk / chunk_warps: the chunk pass's entries and warps per program; shared_warps: the shared
    pass's warps per program (benchmarks/bench_planner.py sweeps them)."""

    def __init__(self, layout: Layout, s: int, device: torch.device, chunk: int = CHUNK, chunk_warps: int = 4,
                 shared_warps: int = _SHARED_WARPS) -> None:
        R, E, K = layout.num_ranks, layout.config.num_experts, layout.config.topk
        if chunk < 32 or chunk & (chunk - 1):
            raise ValueError(f"chunk={chunk}: the chunk kernel matches whole 32-entry blocks; "
                             "pass a power of two >= 32")
        self.chunk, self.chunk_warps, self.shared_warps = chunk, chunk_warps, shared_warps
        self.num_chunks = triton.cdiv(s * K, chunk)
        i32 = {"dtype": torch.int32, "device": device}
        self.rank_in_chunk = torch.empty(s * K, **i32)
        self.chunk_hist = torch.empty(self.num_chunks, E, **i32)  # histograms, then prefixes
        self.end_ER = torch.empty(E, R, **i32)
        self.rowbase_ER = torch.empty(E, R, **i32)
        # the chunk kernel's bit planes: per chunk [chunk / 32 blocks, BITS_P bits of an expert id < E + 1]
        self.bits = E.bit_length()
        self.planes = torch.empty(self.num_chunks * (chunk // 32) * triton.next_power_of_2(self.bits), **i32)


def chunk_pass(topk_sK: torch.Tensor, rank: int, hist_all: torch.Tensor, work: _Workspace) -> None:
    """Step 1: chunk ranks and prefixes into `work`; the local histogram into row `rank` of every
    rank's region of hist_all ([R, R, E] int32, region r = hist_all[r], any strides)."""
    count_step(topk_sK, hist_all.shape[2], work)
    prefix_step(rank, hist_all, work)


def count_step(topk_sK: torch.Tensor, E: int, work: _Workspace) -> None:
    """`_chunk_match_kernel`: per-chunk histograms and ranks inside the chunk."""
    _chunk_match_kernel[(work.num_chunks,)](
        topk_sK, work.rank_in_chunk, work.chunk_hist, work.planes, topk_sK.numel(), E, CHUNK=work.chunk,
        BITS=work.bits, BITS_P=triton.next_power_of_2(work.bits), E_P=triton.next_power_of_2(E),
        HW_POPC=topk_sK.is_cuda, num_warps=work.chunk_warps)


def prefix_step(rank: int, hist_all: torch.Tensor, work: _Workspace) -> None:
    """`_prefix_kernel`: prefixes over chunks, the local histogram into every rank's region."""
    R, _, E = hist_all.shape
    C = work.num_chunks
    assert hist_all.stride(2) == 1
    block_c = min(_PREFIX_CHUNKS, triton.next_power_of_2(C))
    block_e = max(1, min(16, _PREFIX_TILE // block_c))
    _prefix_kernel[(triton.cdiv(E, block_e),)](
        work.chunk_hist, hist_all, C, rank, hist_all.stride(0), hist_all.stride(1), E, R=R,
        BLOCK_C=block_c, BLOCK_E=block_e, num_warps=4)


def plan_pass(topk_sK: torch.Tensor, rank: int, hist_RE: torch.Tensor, work: _Workspace, out: dict[str, torch.Tensor],
              layout: Layout, cap_base: int, cap_rem: int) -> None:
    """Steps 3-4 from this rank's gathered hist region [R, E] into the Plan tensors `out`."""
    shared_step(rank, hist_RE, work, out, layout, cap_base, cap_rem)
    dest_step(topk_sK, work, out, layout)


def shared_step(rank: int, hist_RE: torch.Tensor, work: _Workspace, out: dict[str, torch.Tensor], layout: Layout,
                cap_base: int, cap_rem: int) -> None:
    """`_shared_kernel`, one program per rank: the shared fields and the per-(expert, rank) tables."""
    R, E, B = layout.num_ranks, layout.config.num_experts, layout.num_slots
    epn = E // R
    assert hist_RE.is_contiguous()
    r_p, epn_p = triton.next_power_of_2(R), triton.next_power_of_2(epn)
    _shared_kernel[(R,)](
        hist_RE, out["counts_RE"], out["cap_R"], out["quota_RR"], out["alloc_ER"], out["slot_expert_RB"],
        out["group_rows_RG"], out["offs_RG"], work.end_ER, work.rowbase_ER, rank, cap_base, cap_rem,
        R=R, EPN=epn, B=B, PAD=layout.config.token_padding, R_P=r_p, EPN_P=epn_p,
        G_P=triton.next_power_of_2(E + B), B_P=triton.next_power_of_2(B), LOG_R_P=r_p.bit_length() - 1,
        LOG_EPN_P=epn_p.bit_length() - 1, KEY64=_key64(layout), num_warps=work.shared_warps)


def _key64(layout: Layout) -> bool:
    """Whether the shared kernel's argmax keys need int64: every token count it ranks (balances,
    quotas, expert counts) is at most R * max_tokens * K in magnitude, shifted left by the index
    bits (at most those of EPN_P or R_P) into an int32 key with a bit to spare."""
    R, E, K = layout.num_ranks, layout.config.num_experts, layout.config.topk
    idx_bits = max(triton.next_power_of_2(R), triton.next_power_of_2(E // R)).bit_length() - 1
    return (R * layout.config.max_tokens * K) << idx_bits >= 2**30


def dest_step(topk_sK: torch.Tensor, work: _Workspace, out: dict[str, torch.Tensor], layout: Layout) -> None:
    """`_dest_kernel`: this rank's (dst_rank, dst_row, copy_row, sent)."""
    R, E = layout.num_ranks, layout.config.num_experts
    s, K = topk_sK.shape
    r_p, k_p = triton.next_power_of_2(R), triton.next_power_of_2(K)
    block_t = max(1, min(_DEST_ENTRIES // k_p, _DEST_TILE // (k_p * r_p)))  # large K * R: fewer tokens
    _dest_kernel[(triton.cdiv(s, block_t),)](
        topk_sK, work.rank_in_chunk, work.chunk_hist, work.end_ER, work.rowbase_ER,
        out["dst_rank_sK"], out["dst_row_sK"], out["copy_row_sK"], out["sent_sK"].view(torch.uint8), s, E, K,
        R=R, R_P=r_p, K_P=k_p, BLOCK_T=block_t, CHUNK=work.chunk, num_warps=4)


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
        self._graphs: dict[tuple, PlanPool] = {}

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
        """Plans in the graph pools over all shapes (see PlanPool)."""
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
        pool = self._graphs[key] = PlanPool(topk_sK.clone(), plan_layout)
        pool.release(self._capture(pool, total))
        return plan_layout.plan(flat)

    def _capture(self, pool: PlanPool, total: int | None) -> PooledPlan:
        """A new pool entry: a graph of the plan's launches that writes into the entry's own Plan."""
        flat = pool.layout.empty(pool.topk_in.device)
        out = pool.layout.views(flat)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads/streams of a training step (FSDP, NCCL) may keep working
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._launch(pool.topk_in, out, total)
        del out  # the graph writes into flat's memory; the entry's Plan gets views of its own
        entry = PooledPlan(graph, flat, pool.layout.plan(flat))
        pool.entries.append(entry)
        return entry
