"""The symmetric heap: per-rank physical allocations that every rank of the group maps.

A *segment* is one collective allocation: every rank creates a physical chunk of the same size
and every rank imports every peer's chunk. A *mapping* places pieces of (segment, rank) chunks
side by side in one new virtual range of this process, so the same physical memory can appear in
several views (W_full, W_compact, W_slots_all, ...). Mapping is local (not collective): every
rank maps its own views once the segments exist.

Backends (CPU: memfd + mmap, GPU: CUDA VMM) implement the small `HeapBackend` protocol; all
bookkeeping, validation and the collective protocol live here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moonep.heap.fd_exchange import close_fds, exchange_fds


class HeapBackend(Protocol):
    granularity: int  # bytes; every mapped piece must be a multiple of it
    device: torch.device

    def create(self, nbytes: int) -> Any: ...  # local physical allocation handle
    def export_fd(self, handle: Any) -> int: ...  # a new POSIX fd for the handle
    def import_fd(self, fd: int, nbytes: int) -> Any: ...  # handle for a peer's allocation
    def release(self, handle: Any) -> None: ...
    def reserve(self, nbytes: int) -> int: ...  # virtual range, returns its address
    def map(self, addr: int, handle: Any, offset: int, nbytes: int) -> None: ...
    def free_range(self, addr: int, nbytes: int) -> None: ...  # unmap everything in it, release VA
    def tensor(self, addr: int, nbytes: int) -> torch.Tensor: ...  # uint8 tensor over the range
    def barrier(self, heap: SymmetricHeap, call: str) -> None: ...  # stream-ordered where it can be
    def host_barrier(self, heap: SymmetricHeap, call: str) -> None: ...  # the hosts meet (setup steps)
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    nbytes: int
    handles: tuple[Any, ...]  # per rank of the group


@dataclass(frozen=True, slots=True)
class Piece:
    segment: Segment
    rank: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Mapping:
    addr: int
    nbytes: int
    bytes_u8: torch.Tensor  # uint8 view of the whole range


def view(mapping: Mapping, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Typed tensor of `shape` at byte `offset` of a mapping (contiguous)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    assert offset % itemsize == 0 and offset + nbytes <= mapping.nbytes, (offset, nbytes, mapping.nbytes)
    return mapping.bytes_u8[offset : offset + nbytes].view(dtype).view(shape)


def strided_view(
    mapping: Mapping, offset: int, rank_stride: int, num_ranks: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """[num_ranks, *shape] view where rank r's block starts at offset + r * rank_stride bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    inner = 1
    for n in shape:
        inner *= n
    assert offset % itemsize == 0 and rank_stride % itemsize == 0
    assert offset + (num_ranks - 1) * rank_stride + inner * itemsize <= mapping.nbytes
    base = mapping.bytes_u8.view(dtype) if mapping.nbytes % itemsize == 0 else None
    assert base is not None
    strides = [rank_stride // itemsize]
    acc = 1
    inner_strides = []
    for n in reversed(shape):
        inner_strides.append(acc)
        acc *= n
    strides += list(reversed(inner_strides))
    return base.as_strided((num_ranks, *shape), strides, offset // itemsize)


class SymmetricHeap:
    """Collective allocator of symmetric memory over a process group (one host)."""

    def __init__(self, group: dist.ProcessGroup, backend: HeapBackend, *, timeout_s: float) -> None:
        self.group = group
        self.backend = backend
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._segments: list[Segment] = []
        self._mappings: list[Mapping] = []
        self._destroyed = False

    @property
    def granularity(self) -> int:
        return self.backend.granularity

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def local_bytes(self) -> int:
        """Physical bytes this rank allocated (its chunk of every segment)."""
        return sum(seg.nbytes for seg in self._segments)

    def barrier(self, call: str) -> None:
        """Every rank of the group reaches `call`; raises MoonEPTimeoutError naming it otherwise."""
        self._check_alive(call)
        self.backend.barrier(self, call)

    def alloc(self, name: str, nbytes: int) -> Segment:
        """Collective: one chunk of `nbytes` per rank, zero-initialised, imported by every rank."""
        self._check_alive(f"alloc({name})")
        if nbytes <= 0 or nbytes % self.granularity:
            raise ValueError(
                f"symmetric segment {name!r} of {nbytes} bytes is not a positive multiple of the "
                f"{self.granularity}-byte mapping granularity of the {self.device.type} heap; "
                "change the sizes so that every mapped piece is a multiple of it"
            )
        sizes: list[Any] = [None] * self.world_size
        dist.all_gather_object(sizes, (name, nbytes), group=self.group)
        if any(s != (name, nbytes) for s in sizes):
            raise ValueError(f"symmetric alloc differs across ranks: {sizes}; every rank must allocate "
                             "the same segments in the same order")
        local = self.backend.create(nbytes)
        fd = self.backend.export_fd(local)
        try:
            fds = exchange_fds([fd], group=self.group, barrier=lambda c: self.backend.host_barrier(self, c),
                              timeout_s=self.timeout_s)
        finally:
            close_fds([fd])
        handles: list[Any] = []
        for r in range(self.world_size):
            if r == self.rank:
                handles.append(local)
            else:
                try:
                    handles.append(self.backend.import_fd(fds[r][0], nbytes))
                finally:
                    close_fds(fds[r])
        segment = Segment(name, nbytes, tuple(handles))
        self._segments.append(segment)
        return segment

    def map(self, pieces: list[Piece]) -> Mapping:
        """Local: map the pieces back to back in one new virtual range."""
        self._check_alive("map")
        total = 0
        for p in pieces:
            if p.nbytes <= 0 or p.nbytes % self.granularity or p.offset % self.granularity:
                raise ValueError(
                    f"piece of segment {p.segment.name!r} (offset {p.offset}, {p.nbytes} bytes) is not "
                    f"aligned to the {self.granularity}-byte granularity of the {self.device.type} heap; "
                    "contiguous views need every expert block to be a multiple of it"
                )
            assert p.offset + p.nbytes <= p.segment.nbytes
            total += p.nbytes
        addr = self.backend.reserve(total)
        cursor = addr
        for p in pieces:
            self.backend.map(cursor, p.segment.handles[p.rank], p.offset, p.nbytes)
            cursor += p.nbytes
        mapping = Mapping(addr, total, self.backend.tensor(addr, total))
        self._mappings.append(mapping)
        return mapping

    def destroy(self) -> None:
        """Unmap every view and release every allocation. Idempotent; tensors over the heap become
        invalid. Not collective: safe to call from error paths."""
        if self._destroyed:
            return
        self._destroyed = True
        for m in self._mappings:
            self.backend.free_range(m.addr, m.nbytes)
        for seg in self._segments:
            for h in seg.handles:
                self.backend.release(h)
        self._mappings.clear()
        self._segments.clear()
        self.backend.close()

    def _check_alive(self, call: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"moonep symmetric heap used after destroy() (in {call})")
