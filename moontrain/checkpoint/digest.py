"""Checkpoint file digests that several cores compute at once: the sha256 of each BLOCK_BYTES block of a file.

One sha256 over a whole file runs on one core (~1.3-2 GB/s with SHA-NI), which bounds a save or a load's
verification of a rank file of tens of GB. A file's digest is therefore the list of the sha256 of its blocks
(bytes [k * block_bytes, (k + 1) * block_bytes), the last one shorter), recorded in the manifest with the
block size; blocks are hashed by a thread pool (hashlib and pread release the GIL).

- BlockSha256 is fed the file's bytes in order while they are written (write_safetensors' `digest`). The
  pieces of one update that fall in different blocks are hashed in parallel and the update returns when all
  are done, so the caller may reuse its buffer afterwards (a 64 MiB write chunk is 4-5 blocks of 16 MiB).
- file_block_sha256 reads a file back block by block on the pool, `threads` x 4 MiB of buffers.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BLOCK_BYTES = 16 << 20  # a quarter of the writer's 64 MiB chunk: one chunk spreads over 4-5 threads
THREADS = min(8, os.cpu_count() or 1)
_INLINE_BYTES = 1 << 20  # an update smaller than this is hashed on the calling thread
_READ_BYTES = 4 << 20  # file_block_sha256 reads a block in pieces of this size: threads x 4 MiB in memory


def _check(block_bytes: int, threads: int) -> None:
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}; the default is {BLOCK_BYTES}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}; the default is min(8, os.cpu_count())")


class BlockSha256:
    """The sha256 of each block of a byte stream fed in order through `update`; `hexdigests()` lists them.
    block_bytes, threads: BLOCK_BYTES and THREADS when None. Use as a context manager (the pool's threads end
    on exit)."""

    def __init__(self, block_bytes: int | None = None, threads: int | None = None) -> None:
        block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        threads = THREADS if threads is None else threads
        _check(block_bytes, threads)
        self.block_bytes = block_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="block-sha256") if threads > 1 else None
        self._blocks: list[Any] = [hashlib.sha256()]  # the last one is the block being filled
        self._filled = 0  # bytes in the last block

    def update(self, data: Any) -> None:
        """Hash the next bytes of the stream (any object with the buffer protocol)."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        pieces: list[tuple[Any, memoryview]] = []
        pos = 0
        while pos < len(view):
            n = min(self.block_bytes - self._filled, len(view) - pos)
            pieces.append((self._blocks[-1], view[pos:pos + n]))
            pos += n
            self._filled += n
            if self._filled == self.block_bytes:
                self._blocks.append(hashlib.sha256())
                self._filled = 0
        if self._pool is None or len(pieces) == 1 or len(view) < _INLINE_BYTES:
            for h, piece in pieces:
                h.update(piece)
            return
        for future in [self._pool.submit(h.update, piece) for h, piece in pieces]:
            future.result()

    def hexdigests(self) -> list[str]:
        """The sha256 (hex) of every block so far; the last one may be partial. An empty stream has none."""
        blocks = self._blocks if self._filled else self._blocks[:-1]
        return [h.hexdigest() for h in blocks]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> BlockSha256:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def file_block_sha256(path: Path, block_bytes: int | None = None, threads: int | None = None) -> list[str]:
    """The sha256 (hex) of every block of the file at `path`, read and hashed by `threads` threads (BLOCK_BYTES
    and THREADS when None)."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    threads = THREADS if threads is None else threads
    _check(block_bytes, threads)
    local = threading.local()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def block(k: int) -> str:
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(min(block_bytes, _READ_BYTES)))
            h, lo, hi = hashlib.sha256(), k * block_bytes, min((k + 1) * block_bytes, size)
            while lo < hi:
                got = os.preadv(fd, [local.buf[:hi - lo]], lo)
                if got <= 0:
                    raise OSError(f"{path}: short read at byte {lo} of {size}")
                h.update(local.buf[:got])
                lo += got
            return h.hexdigest()

        count = -(-size // block_bytes)
        if threads == 1 or count <= 1:
            return [block(k) for k in range(count)]
        with ThreadPoolExecutor(min(threads, count), thread_name_prefix="block-sha256") as pool:
            return list(pool.map(block, range(count)))
    finally:
        os.close(fd)


def first_bad_block(path: Path, want: list[str], block_bytes: int, threads: int | None = None) -> int | None:
    """The index of the first block of `path` whose sha256 is not `want`'s (a missing or extra block counts),
    or None when all match."""
    got = file_block_sha256(path, block_bytes, threads)
    for k in range(max(len(got), len(want))):
        if k >= len(got) or k >= len(want) or got[k] != want[k]:
            return k
    return None
