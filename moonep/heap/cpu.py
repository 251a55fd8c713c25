"""CPU backend of the symmetric heap: memfd chunks mapped with _MAP_FIXED).

Faithful emulation of the CUDA VMM protocol: each rank's chunk is an anonymous shared-memory file
(memfd_create), exported as a file descriptor, passed to peers over a Unix socket, and mapped by
every rank into reserved virtual ranges, so one physical chunk can back several views. Because a
memfd has no name in /dev/shm, nothing can survive a rank that dies. Barriers go over the gloo
group with a timeout (torch.distributed.monitored_barrier), raising MoonEPTimeoutError naming the
call and the ranks that did not arrive.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moonep.errors import MoonEPTimeoutError

if TYPE_CHECKING:
    from moonep.heap.base import SymmetricHeap

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_MAP_FIXED = 0x10


def _check_mmap(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"moonep cpu heap: {what} failed: {os.strerror(err)}")
    return addr


class CpuHeapBackend:
    def __init__(self, group: dist.ProcessGroup) -> None:
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(f"the CPU symmetric heap needs a gloo process group, got backend {backend!r}; "
                             "create the group with backend='gloo'")
        self.group = group
        self.granularity = mmap.PAGESIZE
        self.device = torch.device("cpu")

    def create(self, nbytes: int) -> int:
        fd = os.memfd_create("moonep-heap", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        return fd

    def export_fd(self, handle: int) -> int:
        return os.dup(handle)

    def import_fd(self, fd: int, nbytes: int) -> int:
        size = os.fstat(fd).st_size
        assert size == nbytes, (size, nbytes)
        return os.dup(fd)

    def release(self, handle: int) -> None:
        os.close(handle)

    def reserve(self, nbytes: int) -> int:
        addr = _libc.mmap(None, nbytes, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                          -1, 0)
        return _check_mmap(addr, f"reserving {nbytes} bytes")

    def map(self, addr: int, handle: int, offset: int, nbytes: int) -> None:
        got = _libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                         handle, offset)
        got = _check_mmap(got, f"mapping {nbytes} bytes at {addr:#x}")
        assert got == addr

    def free_range(self, addr: int, nbytes: int) -> None:
        if _libc.munmap(addr, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"moonep cpu heap: munmap failed: {os.strerror(err)}")

    def tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def barrier(self, heap: SymmetricHeap, call: str) -> None:
        if heap.world_size == 1:
            return
        try:
            dist.monitored_barrier(self.group, timeout=timedelta(seconds=heap.timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise MoonEPTimeoutError(
                f"moonep barrier in {call!r} did not complete on rank {heap.rank} within {heap.timeout_s} s: "
                f"a peer died, raised, or is in a different call ({exc})"
            ) from exc

    def host_barrier(self, heap: SymmetricHeap, call: str) -> None:
        self.barrier(heap, call)

    def close(self) -> None:
        pass
