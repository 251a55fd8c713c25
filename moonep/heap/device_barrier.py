"""Device-side cross-rank barrier over the CUDA symmetric heap.

`DeviceBarrier(heap)` is what `CudaHeapBackend.barrier` launches: one Triton kernel of one CTA on
the current stream. It is stream-ordered (work queued before it on any rank happens before work
queued after it on every rank) and never waits on the host: the host only launches, and later
reads a pinned error word without blocking.

Layout: a signal segment of one granularity (2 MiB) per rank, allocated lazily by the first
barrier through the heap itself (collective, host-synchronous: keep the first barrier out of
`torch.cuda.set_sync_debug_mode("error")` regions) and mapped as one contiguous all-ranks view.
In rank q's chunk, int32 words:

    [0, MAX_RANKS)   signal[p]: the last epoch that rank p announced to rank q (written by p only)
    EPOCH_WORD       rank q's own epoch counter (read and written by q only)
    POISON_WORD      non-zero once one of q's barriers timed out (device copy of the error word)

Protocol of barrier number e on rank q (one thread per peer p, lanes past R repeat the last peer):
1. if POISON_WORD != 0, return at once: a barrier already failed, the host raises at its next
   check, and later barriers must not each wait out the timeout.
2. e = EPOCH_WORD + 1, stored back. The epoch lives on the device, not in a kernel argument, so
   the launch is identical every time and can be captured in a CUDA graph.
3. `fence.sc.sys`, then `st.release.sys` of e into signal[q] of every peer p's chunk (peer stores
   over NVLink; the lane for p == q writes the local word).
4. spin with `ld.acquire.sys` on signal[p] of the own chunk until every p has signal[p] >= e, or
   until %globaltimer passes start + timeout_ns.
5. on timeout: POISON_WORD = 1; the pinned host error word gets [call_id + 1, e, mask of the ranks
   that had not arrived], the first slot last after a `fence.sc.sys`, so the host never sees a code
   without its details. Then the kernel exits instead of hanging.

A peer is at most one barrier ahead: it leaves barrier e only after seeing signal e from q, so
while q waits in e every signal[p] is e - 1, e or e + 1, and ">= e" is the whole arrival test
(int32 epochs wrap after 2**31 barriers, which no run reaches).

Memory ordering: kernels queued earlier on this stream have completed before the barrier kernel
starts (stream order); the system-scope fence orders them before the release store of the signal.
A fence orders its own thread's accesses, so the kernels that store to peers (moonep.kernels.
dispatch_combine's scatter and push) also end each of their threads with `fence.sc.sys`: their
NVLink stores are then performed at system scope before the kernel ends, whatever link they took. The reader's acquire load that observes the
signal synchronises with that release, and kernels queued after the barrier start after it
completes, so they see everything the peer wrote before its barrier. Only one barrier may be in
flight per heap (one stream at a time): two concurrent barriers would share one epoch counter.

Errors: the host keeps a table call id -> call name. `check()` reads the error word (a plain read
of pinned host memory, no synchronisation) and raises MoonEPTimeoutError naming the call, the
epoch and the missing ranks; `barrier` checks before every launch. After a timeout the epochs of
the ranks disagree: the heap must be destroyed.

Measured (2xH200 linked by NV18, 2026-11-29, test_barrier_in_a_cuda_graph_orders_peer_writes):
2.8 us per barrier inside a CUDA graph (100 barriers back to back); a 1 MiB peer write + barrier +
check + barrier step takes 31 us in a graph. Launched eagerly, the Triton launch costs the host
about 30-40 us per barrier, so eager loops are host-bound (212-226 us for the same step).

Rejected: a host barrier (NCCL barrier or a stream synchronize) blocks the CPU on every call and
cannot be captured; NVLink multicast / multimem reductions are forbidden on our machines; an epoch
passed as a kernel argument would be frozen into a captured graph.
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
