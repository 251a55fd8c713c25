"""CUDA backend of the symmetric heap: driver virtual memory management (VMM) via `cuda.bindings`.

Each rank's chunk is a cuMemCreate allocation of pinned device memory on the rank's GPU, shareable as
a POSIX file descriptor. The descriptor from cuMemExportToShareableHandle travels to every peer over an
abstract Unix socket (fd_exchange.py) and comes back as a handle from cuMemImportFromShareableHandle. A
view is a cuMemAddressReserve range in which the pieces are cuMemMap'ed back to back, each followed by
cuMemSetAccess(read/write) for the local device: a peer's chunk mapped here is accessed over NVLink.
One chunk may be mapped in many views, so W_full, W_compact and W_slots_all share memory (docs/moonep.md
§4). Sizes and offsets are multiples of the allocation granularity (2 MiB on H200).

Zero-initialisation: a new chunk is mapped once into a temporary range, cleared with cuMemsetD8,
synchronised and unmapped before its descriptor is exported, so no peer can see or write it
earlier.

Whole chunks only: cuMemMap of part of an allocation returned CUDA_ERROR_NOT_SUPPORTED (2xH200,
driver 580.159, 2026-11-29), so `map` rejects such pieces with a ValueError; every view of moonep's
layout maps whole segments.

Tensors: `tensor(addr, nbytes)` wraps the range in a non-owning storage on this rank's device
(torch._C._construct_storage_from_data_pointer, as PyTorch's CUDA-graph trees do), so the device never
depends on cuPointerGetAttribute(DEVICE_ORDINAL), which answered 0 for a peer's chunk on both ranks.
Rejected: `__cuda_array_interface__` (it rests on that pointer query).

Teardown: `free_range` synchronises the device (nothing may still use the range), unmaps each
piece and frees the address range; `release` drops the handle. Physical memory is returned when
every process that imported it has released it too. destroy() idempotence is SymmetricHeap's.

Barriers: the heap's own setup steps (e.g. the fd exchange's "sockets are listening" step) need
the hosts to meet: `host_barrier`, an object collective over the group that also checks every
rank is in the same call. Every data-path call uses `barrier`: the device-side, stream-ordered
barrier of device_barrier.py.

Never NVLink multicast: no cuMulticast* call and no multimem instruction anywhere in this backend.
Driver errors raise RuntimeError naming the call and the CUresult.

Measured (2xH200 NV18, 2026-11-29): 372-388 GB/s per direction writing a peer's chunk with the copy
engine, both directions at once (docs/performance.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moonep.errors import MoonEPTimeoutError

if TYPE_CHECKING:
    from moonep.heap.base import SymmetricHeap
    from moonep.heap.device_barrier import DeviceBarrier



class CudaHeapBackend:
    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        from cuda.bindings import driver  # imported here: CPU-only machines never need cuda-bindings

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaHeapBackend needs a CUDA device, got {device}")
        index = torch.cuda.current_device() if device.index is None else device.index
        self.group = group
        self.device = torch.device("cuda", index)
        self._cu = driver
        self._check(driver.cuInit(0), "cuInit")
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._access = driver.CUmemAccessDesc()
        self._access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        with torch.cuda.device(self.device):  # makes the device's primary context current
            self.granularity = int(self._check(
                driver.cuMemGetAllocationGranularity(
                    self._prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity"))
        self._ranges: dict[int, tuple[int, list[tuple[int, int]]]] = {}  # addr -> (nbytes, mapped pieces)
        self._chunk_nbytes: dict[int, int] = {}  # int(handle) -> size of the allocation
        self._barrier: DeviceBarrier | None = None

    # -- physical chunks ------------------------------------------------------------------------

    def create(self, nbytes: int) -> Any:
        assert nbytes > 0 and nbytes % self.granularity == 0, (nbytes, self.granularity)
        cu = self._cu
        with torch.cuda.device(self.device):
            handle = self._check(cu.cuMemCreate(nbytes, self._prop, 0), f"cuMemCreate({nbytes} bytes)")
            self._chunk_nbytes[int(handle)] = nbytes
            try:
                addr = self.reserve(nbytes)
                try:
                    self.map(addr, handle, 0, nbytes)
                    self._check(cu.cuMemsetD8(addr, 0, nbytes), "cuMemsetD8")
                finally:
                    self.free_range(addr, nbytes)
            except BaseException:
                self.release(handle)
                raise
        return handle

    def export_fd(self, handle: Any) -> int:
        with torch.cuda.device(self.device):
            fd = self._check(
                self._cu.cuMemExportToShareableHandle(
                    handle, self._cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                "cuMemExportToShareableHandle")
        return int(fd)

    def import_fd(self, fd: int, nbytes: int) -> Any:
        with torch.cuda.device(self.device):
            handle = self._check(
                self._cu.cuMemImportFromShareableHandle(
                    fd, self._cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                f"cuMemImportFromShareableHandle(fd {fd}, {nbytes} bytes)")
        self._chunk_nbytes[int(handle)] = nbytes
        return handle

    def release(self, handle: Any) -> None:
        with torch.cuda.device(self.device):
            self._check(self._cu.cuMemRelease(handle), "cuMemRelease")
        del self._chunk_nbytes[int(handle)]

    # -- virtual ranges ---------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> int:
        with torch.cuda.device(self.device):
            addr = int(self._check(self._cu.cuMemAddressReserve(nbytes, self.granularity, 0, 0),
                                   f"cuMemAddressReserve({nbytes} bytes)"))
        self._ranges[addr] = (nbytes, [])
        return addr

    def map(self, addr: int, handle: Any, offset: int, nbytes: int) -> None:
        cu = self._cu
        base = max(a for a in self._ranges if a <= addr)
        chunk_nbytes = self._chunk_nbytes[int(handle)]
        if offset != 0 or nbytes != chunk_nbytes:
            self.free_range(base, self._ranges[base][0])  # leave no half-built view behind
            raise ValueError(
                f"the CUDA heap maps whole chunks only, not {nbytes} bytes at offset {offset} of a "
                f"{chunk_nbytes}-byte chunk: cuMemMap of part of an allocation returns CUDA_ERROR_NOT_SUPPORTED "
                "on our driver; allocate that part as a segment of its own")
        with torch.cuda.device(self.device):
            self._check(cu.cuMemMap(addr, nbytes, offset, handle, 0),
                        f"cuMemMap({nbytes} bytes at offset {offset} to {addr:#x})")
            try:
                self._check(cu.cuMemSetAccess(addr, nbytes, [self._access], 1), f"cuMemSetAccess({addr:#x})")
            except BaseException:
                cu.cuMemUnmap(addr, nbytes)
                raise
        self._ranges[base][1].append((addr, nbytes))

    def free_range(self, addr: int, nbytes: int) -> None:
        cu = self._cu
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # no kernel may still use the range
            reserved, pieces = self._ranges.pop(addr)
            assert reserved == nbytes, (reserved, nbytes)
            for piece_addr, piece_nbytes in pieces:
                self._check(cu.cuMemUnmap(piece_addr, piece_nbytes), f"cuMemUnmap({piece_addr:#x})")
            self._check(cu.cuMemAddressFree(addr, nbytes), f"cuMemAddressFree({addr:#x}, {nbytes} bytes)")

    def tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        storage = torch._C._construct_storage_from_data_pointer(addr, self.device, nbytes)
        out = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,))
        assert out.data_ptr() == addr and out.device == self.device, (out.data_ptr(), addr, out.device)
        return out

    # -- barriers ---------------------------------------------------------------------------------

    def barrier(self, heap: SymmetricHeap, call: str) -> None:
        if heap.world_size == 1:
            return
        if self._barrier is None:
            from moonep.heap.device_barrier import DeviceBarrier  # needs triton: GPU machines only

            self._barrier = DeviceBarrier(heap)
        self._barrier(call)

    def check(self) -> None:
        """Raise MoonEPTimeoutError if an earlier device barrier timed out; never blocks."""
        if self._barrier is not None:
            self._barrier.check()

    def close(self) -> None:
        self._barrier = None

    # -- helpers ----------------------------------------------------------------------------------

    def host_barrier(self, heap: SymmetricHeap, call: str) -> None:
        """Host-side meeting of the ranks (the heap's own setup steps, e.g. the fd exchange)."""
        calls: list[Any] = [None] * heap.world_size
        with torch.cuda.device(self.device):
            dist.all_gather_object(calls, call, group=self.group)
        if any(c != call for c in calls):
            raise MoonEPTimeoutError(f"moonep heap step {call!r} on rank {heap.rank} met other calls on the "
                                     f"ranks of the group: {calls}; every rank must run the same heap calls")

    def _check(self, result: tuple, call: str) -> Any:
        err = result[0]
        if err != self._cu.CUresult.CUDA_SUCCESS:
            _, text = self._cu.cuGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else text
            raise RuntimeError(f"moonep cuda heap: {call} failed with {err.name} ({int(err)}): {text}")
        return result[1] if len(result) == 2 else None
