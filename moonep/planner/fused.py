"""The fused planner: docs/moonep.md §5 in four Triton launches around the histogram barrier, bitwise
equal to `moonep.planner.reference.make_plan` (the specification) on every field of the Plan. Buffers
on the triton path plan with it. This module is the host side (workspaces, launches, CUDA graphs); the
kernels are in moonep.planner.fused_kernels.

Protocol of one plan (every rank; flat entry index i = t*K + k):
    1. `_chunk_match_kernel`, one program per CHUNK entries: the chunk's expert histogram and each
       entry's rank among the chunk's entries of its expert, by bit-sliced matching against 32-entry
       blocks (popcounts; no histogram op, no sort). `_prefix_kernel` turns the per-chunk histograms
       into prefixes over chunks and stores the local histogram into row `rank` of every peer's hist.
    2. barrier "dispatch:histograms" (its fence, release and acquire plus stream order publish 1's
       peer stores to 3 and 4 on every rank).
    3. `_shared_kernel`, one program per rank d (§5.1-§5.4, lowest index on ties): every program
       repeats the receiver filling, then program d splits the quotas of its own group and of its one
       donor (§5.2) and writes rank d's slots, group rows and offs, and the tables step 4 reads.
    4. `_dest_kernel`, one program per BLOCK_T tokens: §5.5 for this rank's entries, the dedup in
       registers over a [tokens, K, R] tile.
All outputs live in one flat byte buffer that `_PlanLayout` cuts into the Plan's tensors. An argmax is
one max-reduction of a key (value high, the index's complement low); padded lanes never win.

CUDA graphs: the four launches of a shape are captured, each graph writing its own pooled Plan
(`PlanPool`); a call copies topk into the graph's input and replays a graph whose Plan nothing outside
the pool still holds, capturing a new one when all are held, so a plan saved for backward outlives
later calls. Pool contract: a stream that reads a Plan is joined to the caller's before the Plan is
dropped. Under stream capture and on the CPU heap the kernels launch directly. No host sync.

The histogram is counted from topk_sK: tokens_per_expert_E must equal it (§8; check_values) and is
not read. The hist region is single-buffered: Buffer.plan passes "plan:enter" between two plans.
Why Triton: its interpreter runs these kernels on the CPU, so CI checks them bitwise before a GPU does.

Measured (H200, 2026-12-01, E=896, K=16, R=8 simulated, S=8192, maxvio 1; bench_planner): 26.2 us per
idle graph replay of the four kernels, 21.5 us back to back (docs/performance.md: kernels, variants).

Rejected: a sorting chunk kernel (36 us); blocked comparisons for the ranks (43 us); the prefixes in
the last chunk program; a [CHUNK, E] one-hot cumsum; the shared kernel at 1 warp (spills); one
persistent kernel with a grid barrier; eager launches (~100 us of host); the PyTorch planner in a graph
(~400 kernels); CuTe DSL (experiments/cute_planner); one shared program for all ranks; [tokens, K, K] dedup.
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
    b_p = max(1, triton.next_power_of_2(B))  # B = 0 (one rank): a one-lane tile, every lane masked
    _shared_kernel[(R,)](
        hist_RE, out["counts_RE"], out["cap_R"], out["quota_RR"], out["alloc_ER"], out["slot_expert_RB"],
        out["group_rows_RG"], out["offs_RG"], work.end_ER, work.rowbase_ER, rank, cap_base, cap_rem,
        R=R, EPN=epn, B=B, PAD=layout.config.token_padding, R_P=r_p, EPN_P=epn_p,
        G_P=triton.next_power_of_2(E + B), B_P=b_p, LOG_R_P=r_p.bit_length() - 1,
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
    """(base, remainder) with cap_d = base + (d < remainder): §5.1 as moonep.planner.receive_caps."""
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
