"""safetensors files read and written with plain file I/O, one tensor (or row range) at a time.

The safetensors library maps a file into memory; the pages a read touches stay resident, and counted
in the process's RSS, for as long as the file is open. Checkpoint loads and the HF export read files
of many GB, so they read with pread into a fresh tensor instead (only that tensor is resident), and
the export writes a file tensor by tensor from a header planned from the shapes alone.

Format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end)} relative to the data start, "__metadata__": {...}}, then the data, C order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


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
        except Exception:
            os.close(self.fd)
            raise
        header.pop("__metadata__", None)
        self.data_start = 8 + head_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for name, e in header.items():
            if e["dtype"] not in DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {e['dtype']}, not one of {sorted(DTYPES)}")
            begin, end = e["data_offsets"]
            dtype, shape = DTYPES[e["dtype"]], tuple(e["shape"])
            if end - begin != torch.Size(shape).numel() * dtype.itemsize or self.data_start + end > size:
                raise ValueError(f"tensor {name!r}: data_offsets {e['data_offsets']} do not fit its shape or the file")
            self.entries[name] = (dtype, shape, begin)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        dtype, shape, begin = self.entries[name]
        if not shape:
            lo, hi, shape = 0, 1, (1,)
            out_shape: tuple[int, ...] = ()
        else:
            out_shape = (hi - lo, *shape[1:])
        row_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
        out = torch.empty(out_shape, dtype=dtype)
        buf = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        offset, done = self.data_start + begin + lo * row_bytes, 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{self.path}: short read of {name!r}")
            done += n
        return out

    def tensor(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 0)

    def close(self) -> None:
        os.close(self.fd)


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> int:
    """Write (name, shape, dtype, read) entries: the header from the planned shapes, then each tensor as
    `read()` returns it (one in memory at a time). Returns the data bytes written."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with path.open("wb") as fh:
        fh.write(len(head).to_bytes(8, "little"))
        fh.write(head)
        for name, shape, dtype, read in entries:
            t = read()
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise AssertionError(f"{name}: read {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
            if t.numel():
                fh.write(t.view(-1).view(torch.uint8).numpy())
            del t
    return offset
