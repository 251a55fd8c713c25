"""CuTe DSL kernel of the planner's shared part (docs/moonep.md §5.2-§5.4), bitwise equal to
`moonep.planner.reference.plan_shared` (the specification). An experiment, not part of moonep: moonep's
planner is the fused Triton planner (moonep.planner.fused), which also does the histogram exchange and
the token destinations; this kernel covers the shared part only.

Protocol: one CTA of NUM_THREADS threads (NUM_WARPS warps) holds the problem in shared memory and
runs the specification's greedy steps with the same tie rules. Every argmax/argmin is two warp
reductions (redux.sync): the extreme value, then the minimum index holding it, which is the
lowest-index tie rule of torch.argmax/argmin. Phases, separated by CTA barriers:
    A. all threads: count_E = sum over ranks of counts_RE (sRem, the "remaining" of 5.3), zero
       quota (sQuota) and alloc
    B. warp per home group h: group_h = sum of h's epn counts (sGroup)
    C. warp 0, receiver filling (5.2): balance_h lives in registers (lane l holds h = l and
       h = l + 32, so R <= 64); a step reduces argmax/argmin over the warp, lane 0 adds the quota;
       stops after R - 1 steps or at the first inactive step (max balance <= 0 leaves the
       balances unchanged, so every later masked step of the specification is a no-op)
    D. warp per donor h, quota split (5.3): the row's quota goes to global memory (int64) first,
       then each step d = argmax of the quota row, le = argmax of h's remaining counts (each lane
       scans a strided part, keeping its first maximum), take = min of both, lane 0 updates
       quota, remaining and alloc, __syncwarp. Donors never share state (their quota rows,
       remaining counts and alloc rows are disjoint), so they run independently, each until a
       step takes 0 (the state is then unchanged, so every later masked step of the
       specification is a no-op too) or epn + R - 1 steps. Then alloc[e, h] += remaining[e].
    E. warp per receiving rank d, slots and offsets (5.4): experts in chunks of 32 ascending;
       a ballot of "remote with tokens" gives each expert its slot (remote experts before it);
       inclusive warp scans of the padded rows give offs for the home rows (g < E) directly and,
       relative to the end of the home rows, for the filled slots
    F. all threads: filled slots get the home rows' end added; empty slots get expert -1, 0 rows
       and the final offset.
Every output element is written by the kernel (outputs are torch.empty, no memset); phase F reads
in global memory what phase E wrote from other threads, ordered by the CTA barrier.

Integers: as in the Triton kernel the kernel computes in int32 (counts, caps, balances, quotas
and offsets are bounded by the s*K*R entries of one step) and stores quota_RR and group_ER as
int64, alloc_ER, group_rows_RG and offs_RG as int32, like the specification.

Where it differs from the Triton kernel: Triton holds the whole problem as register tiles padded to
powers of two ([R_P, EPN_P, R_P] for alloc) and runs the quota split for all donors at once over
the whole tile; here the state is in shared memory, donors and receivers map to warps, an argmax
is a redux.sync pair instead of a tile reduction, and the filling and split loops stop at their
first no-op step instead of running every masked step. alloc [E, R] lives in shared memory while
the kernel's shared memory stays within 48 KiB (no opt-in attribute; E = 384 up to R = 16,
E = 1024 up to R = 8) and otherwise is accumulated in the int32 output in global memory (the same
code on another tensor; phase A zeroes it).

Rejected: one thread running the specification serially (every argmax a chain of dependent
shared loads: R * epn per split step); CTA-wide argmax over all donors per step (a CTA barrier per
step, while donors are independent and a warp each suffices); alloc always in global memory (an
L2 round trip on every split step and in the slot scan).

Shapes are static: one compile per (R, E, B, token_padding) and device, cached (about 0.2 s to
PTX and cubin on a CPU host). Launch: torch's current stream, arguments through DLPack; nothing
synchronises with the host, so it can be captured in a CUDA graph. Time on the GPU: printed by
experiments/cute_planner/test_cute_planner_gpu.py (not yet recorded).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

NUM_THREADS = 256
NUM_WARPS = NUM_THREADS // 32
MAX_RANKS = 64  # phase C keeps two balances per lane
SMEM_BUDGET = 48 * 1024  # no opt-in attribute needed below this
_INT_MIN = -(2**31)
_NO_INDEX = 2**30  # larger than any index: loses every min-index reduction


def _padded_bytes(num_int32: int) -> int:
    return -(-num_int32 * 4 // 16) * 16


class PlanSharedKernel:
    """Static problem: R ranks, E experts, B slots per rank, token padding."""

    def __init__(self, num_ranks: int, num_experts: int, num_slots: int, token_padding: int) -> None:
        self.R, self.E, self.B, self.pad = num_ranks, num_experts, num_slots, token_padding
        self.epn = num_experts // num_ranks
        self.G = num_experts + num_slots
        R, E = self.R, self.E
        # sRem [E], sQuota [R*R], sGroup, sBase, sFilled, sSlotEnd [R] each
        self.smem_bytes = _padded_bytes(E) + _padded_bytes(R * R) + 4 * _padded_bytes(R)
        self.alloc_in_smem = self.smem_bytes + _padded_bytes(E * R) <= SMEM_BUDGET
        if self.alloc_in_smem:
            self.smem_bytes += _padded_bytes(E * R)

    @cute.jit
    def __call__(self, mCounts: cute.Tensor, mCap: cute.Tensor, mQuota: cute.Tensor, mAlloc: cute.Tensor,
                 mSlot: cute.Tensor, mGroup: cute.Tensor, mRows: cute.Tensor, mOffs: cute.Tensor,
                 stream: cuda.CUstream) -> None:
        self.kernel(mCounts, mCap, mQuota, mAlloc, mSlot, mGroup, mRows, mOffs).launch(
            grid=[1, 1, 1], block=[NUM_THREADS, 1, 1], smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, mCounts: cute.Tensor, mCap: cute.Tensor, mQuota: cute.Tensor, mAlloc: cute.Tensor,
               mSlot: cute.Tensor, mGroup: cute.Tensor, mRows: cute.Tensor, mOffs: cute.Tensor) -> None:
        R, E, B, G, EPN, PAD = self.R, self.E, self.B, self.G, self.epn, self.pad
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()

        smem = cutlass.utils.SmemAllocator()
        sRem = smem.allocate_tensor(cutlass.Int32, cute.make_layout(E), 16)
        sQuota = smem.allocate_tensor(cutlass.Int32, cute.make_layout(R * R), 16)
        sGroup = smem.allocate_tensor(cutlass.Int32, cute.make_layout(R), 16)
        sBase = smem.allocate_tensor(cutlass.Int32, cute.make_layout(R), 16)
        sFilled = smem.allocate_tensor(cutlass.Int32, cute.make_layout(R), 16)
        sSlotEnd = smem.allocate_tensor(cutlass.Int32, cute.make_layout(R), 16)
        alloc = mAlloc  # [E * R], e-major, the output itself unless it fits in shared memory
        if cutlass.const_expr(self.alloc_in_smem):
            alloc = smem.allocate_tensor(cutlass.Int32, cute.make_layout(E * R), 16)

        # A. tokens per expert; zero quota and alloc
        for e in range(tidx, E, NUM_THREADS):
            c = cutlass.Int32(0)
            for r in cutlass.range(R, unroll_full=True):
                c += mCounts[r * E + e]
            sRem[e] = c
        for i in range(tidx, R * R, NUM_THREADS):
            sQuota[i] = cutlass.Int32(0)
        for i in range(tidx, E * R, NUM_THREADS):
            alloc[i] = cutlass.Int32(0)
        cute.arch.sync_threads()

        # B. tokens per home group
        for h in range(warp, R, NUM_WARPS):
            s = cutlass.Int32(0)
            for i in range(lane, EPN, 32):
                s += sRem[h * EPN + i]
            s = cute.arch.warp_redux_sync(s, "add")
            if lane == 0:
                sGroup[h] = s
        cute.arch.sync_threads()

        # C. receiver filling (§5.2), warp 0
        if warp == 0:
            lo_ok = lane < R
            hi_ok = lane + 32 < R
            bal_lo = cutlass.Int32(0)
            bal_hi = cutlass.Int32(0)
            if lo_ok:
                bal_lo = sGroup[lane] - mCap[lane].to(cutlass.Int32)
            if cutlass.const_expr(R > 32):
                if hi_ok:
                    bal_hi = sGroup[lane + 32] - mCap[lane + 32].to(cutlass.Int32)
            step = cutlass.Int32(0)
            go = cutlass.Boolean(R > 1)
            while go:
                # h = argmax, u = argmin over the valid balances, lowest index on ties
                mx = bal_lo if lo_ok else cutlass.Int32(_INT_MIN)
                mn = bal_lo if lo_ok else cutlass.Int32(2**31 - 1)
                if cutlass.const_expr(R > 32):
                    if hi_ok:
                        mx = cutlass.max(mx, bal_hi)
                        mn = cutlass.min(mn, bal_hi)
                bal_h = cute.arch.warp_redux_sync(mx, "max")
                bal_u = cute.arch.warp_redux_sync(mn, "min")
                cand_h = lane if lo_ok and bal_lo == bal_h else cutlass.Int32(_NO_INDEX)
                cand_u = lane if lo_ok and bal_lo == bal_u else cutlass.Int32(_NO_INDEX)
                if cutlass.const_expr(R > 32):
                    if hi_ok and bal_hi == bal_h:
                        cand_h = cutlass.min(cand_h, lane + 32)
                    if hi_ok and bal_hi == bal_u:
                        cand_u = cutlass.min(cand_u, lane + 32)
                h = cute.arch.warp_redux_sync(cand_h, "min")
                u = cute.arch.warp_redux_sync(cand_u, "min")
                active = bal_h > 0
                if active and lane == 0:
                    sQuota[h * R + u] = sQuota[h * R + u] - bal_u
                new_h = bal_h + bal_u if active else bal_h
                new_u = cutlass.Int32(0) if active else bal_u
                # u first, then h: h's value wins when h == u, as in the specification
                if lane == u:
                    bal_lo = new_u
                if lane == h:
                    bal_lo = new_h
                if cutlass.const_expr(R > 32):
                    if lane + 32 == u:
                        bal_hi = new_u
                    if lane + 32 == h:
                        bal_hi = new_h
                step += 1
                go = active and step < R - 1
        cute.arch.sync_threads()

        # D. quota -> experts (§5.3), warp per donor h
        for h in range(warp, R, NUM_WARPS):
            for j in range(lane, R, 32):
                mQuota[h * R + j] = sQuota[h * R + j].to(cutlass.Int64)
            step = cutlass.Int32(0)
            go = cutlass.Boolean(True)
            while go:
                # d = argmax of the quota row
                # (loads stay under `if`: `a and b` evaluates b even when a is False)
                q_lo = cutlass.Int32(_INT_MIN)
                q_hi = cutlass.Int32(_INT_MIN)
                if lane < R:
                    q_lo = sQuota[h * R + lane]
                if cutlass.const_expr(R > 32):
                    if lane + 32 < R:
                        q_hi = sQuota[h * R + lane + 32]
                q = cute.arch.warp_redux_sync(cutlass.max(q_lo, q_hi), "max")
                d_lane = cutlass.Int32(_NO_INDEX)
                if cutlass.const_expr(R > 32):
                    if q_hi == q:
                        d_lane = lane + 32
                if q_lo == q:
                    d_lane = lane
                d = cute.arch.warp_redux_sync(d_lane, "min")
                # le = argmax of h's remaining counts; a lane's first maximum is its lowest index
                rem_lane = cutlass.Int32(_INT_MIN)
                le_lane = cutlass.Int32(_NO_INDEX)
                for i in range(lane, EPN, 32):
                    v = sRem[h * EPN + i]
                    if v > rem_lane:
                        rem_lane = v
                        le_lane = i
                rem = cute.arch.warp_redux_sync(rem_lane, "max")
                le = cute.arch.warp_redux_sync(le_lane if rem_lane == rem else cutlass.Int32(_NO_INDEX), "min")
                take = cutlass.min(q, rem)
                if take != 0 and lane == 0:
                    sQuota[h * R + d] = sQuota[h * R + d] - take
                    sRem[h * EPN + le] = sRem[h * EPN + le] - take
                    a_idx = (h * EPN + le) * R + d
                    alloc[a_idx] = alloc[a_idx] + take
                cute.arch.sync_warp()
                step += 1
                go = take != 0 and step < EPN + R - 1
            for i in range(lane, EPN, 32):
                a_idx = (h * EPN + i) * R + h
                alloc[a_idx] = alloc[a_idx] + sRem[h * EPN + i]
        cute.arch.sync_threads()

        # E. slots, group rows and offsets (§5.4), warp per receiving rank d
        lanes_below = (cutlass.Int32(1) << lane) - 1
        for d in range(warp, R, NUM_WARPS):
            num_remote = cutlass.Int32(0)
            home_end = cutlass.Int32(0)  # padded rows of W_full rows 0 .. e so far
            slot_end = cutlass.Int32(0)  # padded rows of the filled slots so far
            for e0 in range(0, E, 32):
                e = e0 + lane
                ok = e < E
                a = cutlass.Int32(0)
                if ok:
                    a = alloc[e * R + d]
                remote = ok and a > 0 and e // EPN != d
                ballot = cute.arch.vote_ballot_sync(remote)
                slot = num_remote + cute.arch.popc(ballot & lanes_below)
                in_slot = remote and slot < B
                home_rows = cutlass.Int32(0) if in_slot else a
                slot_rows = a if in_slot else cutlass.Int32(0)
                home_off = home_end + _inclusive_warp_sum(lane, (home_rows + (PAD - 1)) // PAD * PAD)
                slot_off = slot_end + _inclusive_warp_sum(lane, (slot_rows + (PAD - 1)) // PAD * PAD)
                if ok:
                    group = E + slot if in_slot else e
                    mGroup[e * R + d] = group.to(cutlass.Int64)
                    mRows[d * G + e] = home_rows
                    mOffs[d * G + e] = home_off
                    if cutlass.const_expr(self.alloc_in_smem):
                        mAlloc[e * R + d] = a
                if in_slot:
                    mSlot[d * B + slot] = e
                    mRows[d * G + E + slot] = slot_rows
                    mOffs[d * G + E + slot] = slot_off  # relative: phase F adds the home rows' end
                num_remote += cute.arch.popc(ballot)
                home_end = cute.arch.shuffle_sync(home_off, 31)
                slot_end = cute.arch.shuffle_sync(slot_off, 31)
            if lane == 0:
                sBase[d] = home_end
                sFilled[d] = cutlass.min(num_remote, B)
                sSlotEnd[d] = slot_end
        cute.arch.sync_threads()

        # F. slot offsets after the home rows; empty slots
        for idx in range(tidx, R * B, NUM_THREADS):
            d = idx // B
            j = idx - d * B
            g = d * G + E + j
            if j < sFilled[d]:
                mOffs[g] = mOffs[g] + sBase[d]
            else:
                mSlot[idx] = cutlass.Int32(-1)
                mRows[g] = cutlass.Int32(0)
                mOffs[g] = sBase[d] + sSlotEnd[d]


@cute.jit
def _inclusive_warp_sum(lane: cutlass.Int32, x: cutlass.Int32) -> cutlass.Int32:
    """Sum of x over lanes 0 .. lane (Hillis-Steele with indexed shuffles)."""
    for k in cutlass.range_constexpr(5):
        off = 1 << k
        y = cute.arch.shuffle_sync(x, cutlass.max(lane - off, 0))
        if lane >= off:
            x = x + y
    return x


# ---------------------------------------------------------------------------------------------- host side
def example_args(num_ranks: int, num_experts: int, num_slots: int, device: torch.device | str) -> list:
    """Kernel tensor arguments of one shape, for tracing (zeros: only shapes and dtypes matter)."""
    R, E = num_ranks, num_experts
    return _kernel_args(*_empty_outputs(R, E, num_slots, torch.device(device)),
                        counts_RE=torch.zeros(R, E, dtype=torch.int32, device=device),
                        cap_R=torch.zeros(R, dtype=torch.int64, device=device))


@functools.cache
def compile_plan_shared(num_ranks: int, num_experts: int, num_slots: int, token_padding: int,
                        device: torch.device) -> Callable:
    """The compiled kernel of one static shape on one device (compiled once, then cached)."""
    kernel = PlanSharedKernel(num_ranks, num_experts, num_slots, token_padding)
    return cute.compile(kernel, *example_args(num_ranks, num_experts, num_slots, device), _current_stream(device))


def _current_stream(device: torch.device) -> cuda.CUstream:
    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def _empty_outputs(R: int, E: int, B: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(quota_RR, alloc_ER, slot_expert_RB, group_ER, group_rows_RG, offs_RG), uninitialised: the
    kernel writes every element."""
    i32 = {"dtype": torch.int32, "device": device}
    i64 = {"dtype": torch.int64, "device": device}
    G = E + B
    return (torch.empty(R, R, **i64), torch.empty(E, R, **i32), torch.empty(R, B, **i32),
            torch.empty(E, R, **i64), torch.empty(R, G, **i32), torch.empty(R, G, **i32))


def _kernel_args(quota: torch.Tensor, alloc: torch.Tensor, slot: torch.Tensor, group: torch.Tensor,
                 rows: torch.Tensor, offs: torch.Tensor, *, counts_RE: torch.Tensor, cap_R: torch.Tensor) -> list:
    """The kernel's tensor arguments: flat views of contiguous tensors (the kernel indexes them
    row-major)."""
    tensors = (counts_RE, cap_R, quota, alloc, slot, group, rows, offs)
    return [from_dlpack(t.view(-1)) for t in tensors]


def check_problem(counts_RE: torch.Tensor, cap_R: torch.Tensor, num_slots: int, token_padding: int) -> None:
    """ValueError unless the problem is one the kernel handles (the specification takes the same)."""
    if counts_RE.dim() != 2:
        raise ValueError(f"counts_RE must be [R, E], got shape {list(counts_RE.shape)}")
    R, E = counts_RE.shape
    if not 1 <= R <= MAX_RANKS or E % R:
        raise ValueError(f"the CuTe planner needs 1 <= R <= {MAX_RANKS} and E divisible by R, got R={R}, E={E}")
    if tuple(cap_R.shape) != (R,):
        raise ValueError(f"cap_R must be [R] = [{R}], got shape {list(cap_R.shape)}")
    if num_slots < 1 or token_padding < 1:
        raise ValueError(f"num_slots and token_padding must be >= 1, got {num_slots} and {token_padding}")
    if counts_RE.device.type != "cuda" or cap_R.device != counts_RE.device:
        raise ValueError(f"counts_RE and cap_R must be on one CUDA device, got {counts_RE.device} and {cap_R.device}")


def plan_shared(counts_RE: torch.Tensor, cap_R: torch.Tensor, num_slots: int, token_padding: int
                ) -> tuple[torch.Tensor, ...]:
    """Same outputs as moonep.planner.plan_shared (quota_RR int64, alloc_ER int32, slot_expert_RB
    int32, group_ER int64, group_rows_RG int32, offs_RG int32), bitwise, from one CuTe DSL kernel
    launch on torch's current stream, without a host sync. The first call of a shape compiles."""
    check_problem(counts_RE, cap_R, num_slots, token_padding)
    counts_RE = counts_RE.to(torch.int32).contiguous()
    cap_R = cap_R.to(torch.int64).contiguous()
    R, E = counts_RE.shape
    device = counts_RE.device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    compiled = compile_plan_shared(R, E, num_slots, token_padding, device)
    outs = _empty_outputs(R, E, num_slots, device)
    compiled(*_kernel_args(*outs, counts_RE=counts_RE, cap_R=cap_R), _current_stream(device))
    return outs
