"""safetensors files read and written with plain file I/O, one tensor (or row range, or chunk) at a time.

The safetensors library maps a file into memory; the pages a read touches stay resident, and counted
in the process's RSS, for as long as the file is open. Checkpoint loads and the HF export read files
of many GB, so they read with pread straight into the destination tensor instead (a CUDA one through
two pinned chunk buffers), and saves and the export write a file from a header planned from the shapes
alone, then tensor by tensor in chunks: a contiguous CPU tensor from its own memory, any other through
two reused staging buffers (pinned, filled on a side CUDA stream, for CUDA tensors) so the next chunk's
copy to the host overlaps the write of this one. The extra host memory of a save or a load is the
staging buffers (2 x CHUNK_BYTES), not the state. The writer's bytes equal
safetensors.torch.save_file's for the same tensors and metadata (the same order, JSON and padding).

Format: 8 bytes little-endian header length N, N bytes of JSON {"__metadata__": {...}, name: {dtype,
shape, data_offsets: [begin, end)} relative to the data start}, padded with spaces to a multiple of 8,
then the data, C order.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# safetensors' Dtype enum order (the dtypes it has that torch has too); its writer sorts by it, widest first
_DTYPE_RANK = {name: i for i, name in enumerate(
    ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64"])}
CHUNK_BYTES = 64 << 20  # staging buffer size: large enough that per-chunk costs vanish next to the copies
_HASH_INLINE_BYTES = 1 << 20  # below this a chunk is hashed on the writing thread


class SafetensorsReader:
    """Header parsed once; `rows(name, lo, hi)` reads rows [lo, hi) of dim 0 (the whole tensor when 0-d)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            head_len = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            if size < 8 or head_len > size - 8:
                raise ValueError(f"header length {head_len} does not fit in a file of {size} bytes")
            header = json.loads(os.pread(self.fd, head_len, 8))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
            header.pop("__metadata__", None)
            self.data_start = 8 + head_len
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            for name, e in header.items():
                if e["dtype"] not in DTYPES:
                    raise ValueError(f"tensor {name!r} has dtype {e['dtype']}, not one of {sorted(DTYPES)}")
                begin, end = e["data_offsets"]
                dtype, shape = DTYPES[e["dtype"]], tuple(e["shape"])
                if not all(type(n) is int and n >= 0 for n in (begin, end, *shape)) \
                        or end - begin != torch.Size(shape).numel() * dtype.itemsize or self.data_start + end > size:
                    raise ValueError(f"tensor {name!r}: data_offsets {e['data_offsets']} do not fit its shape "
                                     f"{list(shape)} or the file")
                self.entries[name] = (dtype, shape, begin)
        except Exception:
            os.close(self.fd)
            raise

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        dtype, shape, _ = self.entries[name]
        out = torch.empty((hi - lo, *shape[1:]) if shape else (), dtype=dtype)
        self.read_into(name, lo, hi, out)
        return out

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Rows [lo, hi) of `name` into `out` (their shape, any device). A contiguous CPU `out` of the file's dtype
        is read into directly; a CUDA one through two reused pinned buffers, the copy of one chunk to the device
        (on a side stream) overlapping the read of the next; any other through a CPU tensor and `copy_`."""
        dtype, shape, begin = self.entries[name]
        if shape and not 0 <= lo <= hi <= shape[0]:  # the header bounds every read: no bytes of another tensor
            raise ValueError(f"{self.path}: rows [{lo}, {hi}) of {name!r} were asked for, it has {shape[0]}")
        want = (hi - lo, *shape[1:]) if shape else ()
        if tuple(out.shape) != want:
            raise AssertionError(f"{self.path}: {name} rows [{lo}, {hi}) have shape {want}, out has {tuple(out.shape)}")
        if out.dtype != dtype or not out.is_contiguous() or out.device.type not in ("cpu", "cuda"):
            out.copy_(self.rows(name, lo, hi))
            return
        row_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
        offset, nbytes = self.data_start + begin + lo * row_bytes, out.numel() * dtype.itemsize
        if nbytes == 0:
            return
        flat = out.detach().reshape(-1).view(torch.uint8)
        if out.device.type == "cpu":
            self._pread(name, memoryview(flat.numpy()), offset)
            return
        stream = torch.cuda.Stream(out.device)
        stream.wait_stream(torch.cuda.current_stream(out.device))  # `out` may be in use by earlier work
        bufs: list[torch.Tensor] = []
        events: list[torch.cuda.Event | None] = [None, None]
        for k, lo_b in enumerate(range(0, nbytes, chunk_bytes)):
            n = min(chunk_bytes, nbytes - lo_b)
            if len(bufs) < 2:
                bufs.append(torch.empty(min(chunk_bytes, nbytes), dtype=torch.uint8, pin_memory=True))
            if events[k % 2] is not None:
                events[k % 2].synchronize()  # this buffer's previous copy to the device is done
            self._pread(name, memoryview(bufs[k % 2].numpy())[:n], offset + lo_b)
            with torch.cuda.stream(stream):
                flat[lo_b:lo_b + n].copy_(bufs[k % 2][:n], non_blocking=True)
                events[k % 2] = torch.cuda.Event()
                events[k % 2].record()
        torch.cuda.current_stream(out.device).wait_stream(stream)
        for event in events:
            if event is not None:
                event.synchronize()  # the pinned buffers are freed on return

    def _pread(self, name: str, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{self.path}: short read of {name!r}")
            done += n

    def tensor(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 0)

    def close(self) -> None:
        os.close(self.fd)


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None, *, digest: Any = None,
                      chunk_bytes: int = CHUNK_BYTES) -> int:
    """Write (name, shape, dtype, read) entries: the header from the planned shapes, then each tensor as
    `read()` returns it, streamed in chunks (see `host_chunks`), in safetensors' own order (see `save_order`).
    `digest`: fed every byte of the file in order (`digest.update(data)`, a hashlib object or a
    digest.BlockSha256), on a side thread while the bytes are written; `data` is reused after the update returns.
    Returns the data bytes written."""
    entries = sorted(entries, key=lambda e: save_order(e[0], e[2]))
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)

    def tensors() -> Iterator[torch.Tensor]:
        for name, shape, dtype, read in entries:
            t = read()
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise AssertionError(f"{name}: read {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
            yield t

    with path.open("wb") as fh, ThreadPoolExecutor(1) if digest is not None else nullcontext() as hasher:
        for data in itertools.chain([memoryview(len(head).to_bytes(8, "little") + head)],
                                    host_chunks(tensors(), chunk_bytes)):
            hashed = None
            if digest is not None:
                if len(data) < _HASH_INLINE_BYTES:
                    digest.update(data)
                else:  # hashlib releases the GIL: hashing a chunk overlaps writing it
                    hashed = hasher.submit(digest.update, data)
            fh.write(data)
            if hashed is not None:
                hashed.result()
    return offset


def save_order(name: str, dtype: torch.dtype) -> tuple[int, str]:
    """safetensors' order: dtypes from the widest down (its Dtype enum, reversed), then names. Every tensor's
    data offset is then a multiple of its element size, and the file equals safetensors.torch.save_file's."""
    return (-_DTYPE_RANK[NAMES[dtype]], name)


def host_chunks(tensors: Iterable[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The bytes of each tensor, C order, as host memoryviews of at most `chunk_bytes` (more only for a single row
    of a non-contiguous tensor that is larger). A contiguous CPU tensor is viewed, not copied. Any other tensor
    is copied in row blocks through two reused host buffers, pinned for CUDA tensors, whose copies run on a side
    stream: block k + 1 is on its way to the host while the caller consumes block k. A view is valid until the
    caller asks for the next one after it."""
    buffers: dict[bool, list[torch.Tensor | None]] = {}  # pinned? -> two staging buffers
    streams: dict[torch.device, torch.cuda.Stream] = {}
    pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
    k = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        if t.device.type == "cpu" and t.is_contiguous():
            if pending is not None:
                yield _ready(*pending)
                pending = None
            flat = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for lo in range(0, len(flat), chunk_bytes):
                yield flat[lo:lo + chunk_bytes]
            continue
        cuda = t.device.type == "cuda"
        if cuda:  # the side stream copies only after the work that produced `t`, which stays alive until then
            if t.device not in streams:
                streams[t.device] = torch.cuda.Stream(t.device)
            streams[t.device].wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(streams[t.device])
        for block in _blocks(t, chunk_bytes):
            nbytes = block.numel() * block.dtype.itemsize
            pair = buffers.setdefault(cuda, [None, None])
            buf = pair[k % 2]
            if buf is None or buf.numel() < nbytes:  # the other buffer may still be in use: replace this one only
                buf = pair[k % 2] = torch.empty(max(nbytes, chunk_bytes), dtype=torch.uint8, pin_memory=cuda)
            dst = buf[:nbytes].view(block.dtype).view(block.shape)
            event = None
            if cuda:
                with torch.cuda.stream(streams[t.device]):
                    dst.copy_(block, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
            else:
                dst.copy_(block)
            k += 1
            if pending is not None:
                yield _ready(*pending)
            pending = (buf[:nbytes], event)
    if pending is not None:
        yield _ready(*pending)


def _blocks(t: torch.Tensor, chunk_bytes: int) -> Iterator[torch.Tensor]:
    """Views of `t` in C order of at most chunk_bytes each: element ranges when contiguous, else dim-0 row ranges."""
    if t.is_contiguous():
        flat, step = t.reshape(-1), max(1, chunk_bytes // t.dtype.itemsize)
        for lo in range(0, flat.numel(), step):
            yield flat[lo:lo + step]
        return
    step = max(1, chunk_bytes // (t[0].numel() * t.dtype.itemsize))
    for lo in range(0, t.shape[0], step):
        yield t[lo:lo + step]


def _ready(buf: torch.Tensor, event: torch.cuda.Event | None) -> memoryview:
    if event is not None:
        event.synchronize()
    return memoryview(buf.numpy())
