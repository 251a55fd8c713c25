"""Device-side cross-rank barrier over the CUDA symmetric heap.

`DeviceBarrier(heap)` is what `CudaHeapBackend.barrier` launches: one Triton kernel of one CTA on
the current stream. It is stream-ordered (work queued before it on any rank happens before work
queued after it on every rank) and never waits on the host: the host only launches, and later
reads a pinned error word without blocking.

Layout: one 2 MiB signal segment per rank, allocated by the first barrier through the heap
(collective, host-synchronous: keep it out of sync-debug "error" regions), mapped as one all-ranks
view. Rank q's chunk holds int32 words: signal[p] for p < MAX_RANKS (the last epoch rank p announced
to q, written by p only), EPOCH_WORD (q's epoch counter) and POISON_WORD (set once a barrier of q timed out).

Protocol of barrier number e on rank q (one thread per peer p):
1. POISON_WORD != 0: return at once (the host raises at its next check; no second wait for the timeout).
2. e = EPOCH_WORD + 1, stored back: the epoch lives on the device, so the launch is the same every
   time and can be captured in a CUDA graph.
3. `fence.sc.sys`, then `st.release.sys` of e into signal[q] of every peer's chunk (over NVLink).
4. spin with `ld.acquire.sys` on the own chunk until every signal[p] >= e, or %globaltimer passes
   start + timeout_ns.
5. on timeout: POISON_WORD = 1; the pinned host error word gets [call_id + 1, e, missing-rank mask],
   the first slot last after a `fence.sc.sys`; the kernel exits instead of hanging.

A peer is at most one barrier ahead: it leaves barrier e only after seeing signal e from q, so
while q waits in e every signal[p] is e - 1, e or e + 1, and ">= e" is the whole arrival test
(int32 epochs wrap after 2**31 barriers, which no run reaches).

Memory ordering: earlier kernels on the stream completed before the barrier starts; the system-scope
fence orders them before the release store. A fence orders only its own thread's accesses, so the
kernels that store to peers (dispatch_combine's scatter and push) end each thread with `fence.sc.sys`
too. The reader's acquire load synchronises with the release, and kernels queued after the barrier see
everything the peer wrote before it. One barrier in flight per heap (one stream at a time).

Errors: `check()` reads the error word (plain pinned-memory read, no sync) and raises
MoonEPTimeoutError naming the call, the epoch and the missing ranks; `barrier` checks before every
launch. After a timeout the ranks' epochs disagree: the heap must be destroyed.

Measured (2xH200 NV18, 2026-11-29): 2.8 us per barrier inside a CUDA graph (docs/performance.md).

Rejected: a host barrier (blocks the CPU every call, cannot be captured); NVLink multicast (forbidden on
our machines); the epoch as a kernel argument (frozen into a captured graph).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moonep.errors import MoonEPTimeoutError
from moonep.heap.base import Piece

if TYPE_CHECKING:
    from moonep.heap.base import SymmetricHeap

MAX_RANKS = 32  # the missing-ranks mask is one int64; one host has at most 8 GPUs
EPOCH_WORD = MAX_RANKS
POISON_WORD = MAX_RANKS + 1


@triton.jit
def _fence_sys(x):
    return tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _st_release_sys(ptrs, values):
    return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [ptrs, values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld_acquire_sys(ptrs):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _globaltimer_ns(x):
    ticks = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64,
                                      is_pure=False, pack=1)
    return tl.max(ticks, axis=0)


@triton.jit(do_not_specialize=["rank", "call_id", "timeout_ns"])
def _barrier_kernel(signals_ptr, err_ptr, rank, world_size, chunk_words, call_id, timeout_ns,
                    EPOCH: tl.constexpr, POISON: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    peers = tl.minimum(lanes, world_size - 1)
    own_ptr = signals_ptr + rank * chunk_words
    poisoned = tl.load(own_ptr + POISON)
    if poisoned == 0:
        epoch = tl.load(own_ptr + EPOCH) + 1
        tl.store(own_ptr + EPOCH, epoch)
        _fence_sys(lanes)
        _st_release_sys(signals_ptr + peers * chunk_words + rank, tl.zeros([BLOCK], tl.int32) + epoch)
        deadline = _globaltimer_ns(lanes) + timeout_ns
        behind = tl.sum((_ld_acquire_sys(own_ptr + peers) < epoch).to(tl.int32), axis=0)
        now = _globaltimer_ns(lanes)
        while (behind > 0) & (now <= deadline):
            behind = tl.sum((_ld_acquire_sys(own_ptr + peers) < epoch).to(tl.int32), axis=0)
            now = _globaltimer_ns(lanes)
        if behind > 0:
            late = (_ld_acquire_sys(own_ptr + peers) < epoch) & (lanes < world_size)
            bits = tl.full([BLOCK], 1, tl.int64) << lanes.to(tl.int64)
            missing = tl.sum(tl.where(late, bits, 0), axis=0)
            tl.store(own_ptr + POISON, 1)
            tl.store(err_ptr + 1, epoch.to(tl.int64))
            tl.store(err_ptr + 2, missing)
            _fence_sys(lanes)
            tl.store(err_ptr, call_id.to(tl.int64) + 1)


class DeviceBarrier:
    """Stream-ordered barrier of every rank of `heap`'s group (see the module docstring).

    Construction is collective (it allocates the signal segment through the heap)."""

    def __init__(self, heap: SymmetricHeap) -> None:
        if heap.world_size > MAX_RANKS:
            raise ValueError(f"the CUDA device barrier supports at most {MAX_RANKS} ranks, the group has "
                             f"{heap.world_size}; use one heap per host")
        self.device = heap.device
        self.rank = heap.rank
        self.world_size = heap.world_size
        self.timeout_s = heap.timeout_s
        self._timeout_ns = int(heap.timeout_s * 1e9)
        self._block = max(32, triton.next_power_of_2(heap.world_size))
        # error word: [call_id + 1 (0: no error), epoch, missing-ranks mask]; device-visible pinned memory
        self._err = torch.zeros(3, dtype=torch.int64, pin_memory=True)
        self._call_ids: dict[str, int] = {}
        self._calls: list[str] = []
        segment = heap.alloc("moonep.device_barrier", heap.granularity)
        mapping = heap.map([Piece(segment, r, 0, segment.nbytes) for r in range(heap.world_size)])
        self._signals = mapping.bytes_u8.view(torch.int32)
        self._chunk_words = segment.nbytes // 4
        # Compile before the first launch: a rank still compiling while its peer spins would look
        # like a hung peer to a short timeout.
        _barrier_kernel.warmup(*self._args(0), grid=(1,), **self._meta())

    def __call__(self, call: str) -> None:
        self.check()
        call_id = self._call_ids.get(call)
        if call_id is None:
            call_id = self._call_ids[call] = len(self._calls)
            self._calls.append(call)
        with torch.cuda.device(self.device):
            _barrier_kernel[(1,)](*self._args(call_id), **self._meta())

    def check(self) -> None:
        """Raise MoonEPTimeoutError if a barrier of this rank timed out; never blocks."""
        code, epoch, missing = (int(v) for v in self._err.tolist())
        if code == 0:
            return
        ranks = [r for r in range(self.world_size) if missing >> r & 1]
        raise MoonEPTimeoutError(
            f"moonep device barrier {self._calls[code - 1]!r} (barrier number {epoch}) timed out on rank "
            f"{self.rank} after {self.timeout_s} s: ranks {ranks} did not arrive (a peer died, raised, or is "
            "in a different call); the heap's barrier state is now inconsistent, destroy the heap"
        )

    def _args(self, call_id: int) -> tuple:
        return (self._signals, self._err, self.rank, self.world_size, self._chunk_words, call_id,
                self._timeout_ns)

    def _meta(self) -> dict[str, int]:
        return {"EPOCH": EPOCH_WORD, "POISON": POISON_WORD, "BLOCK": self._block, "num_warps": 1}
