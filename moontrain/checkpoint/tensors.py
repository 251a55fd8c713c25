"""Canonical tensors stored as dim-0 row ranges, and a reader that reassembles any row range.

Every tensor in a checkpoint has a canonical name and a canonical (global) shape, the one a
single-process model would hold: `model.layers.1.ffn.experts.master.gate_up` is [E, H, 2F] whatever the
EP degree. A rank stores the rows [offset, offset + rows) of it that it owns:

- FSDP2 dense params (DTensor, Shard(0) over the world): the torch.chunk rule, rank r holds
  rows [r * ceil(n / W), ...) clipped to n (a rank past the end holds none and writes nothing);
- expert masters: the EP rank's canonical experts [ep_rank * epn, (ep_rank + 1) * epn), written by
  the first data-parallel replica only (the other replicas hold the same rows);
- expert masters and their optimizer moments under parallel.shard_expert_state: replica d of EP rank r
  holds (and writes) rows [r * epn + d * epn / dp_replicate, ...) of them, epn / dp_replicate rows
  (expert_shard_ownership);
- replicated tensors (unsharded dense params, router biases, Adam's step): rank 0, all rows.

Optimizer moments follow their parameter. Loading asks a `TensorSource` for the rows this rank owns
under the new layout, so a checkpoint saved at one EP / DP degree loads at any other.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard

from moontrain.checkpoint.digest import first_bad_block
from moontrain.checkpoint.safetensors_io import SafetensorsReader
from moontrain.parallel.layout import ParallelLayout

_GATE_UP = re.compile(r"(.*\.experts\.master\.)gate_up(.*)")


def separate_gate_up_names(name: str) -> tuple[str, str] | None:
    """For a name of the experts' gate_up projection (or of its optimizer state): the names its two halves had
    when gate and up were separate projections, else None."""
    m = _GATE_UP.fullmatch(name)
    return None if m is None else (f"{m[1]}gate{m[2]}", f"{m[1]}up{m[2]}")


class CheckpointError(ValueError):
    """A checkpoint (or exported model) that cannot be used; the message names the file."""


RESTORE = ("restore the file from a copy of this checkpoint, or load an earlier checkpoint "
           "(checkpoint.resume=<its directory>)")


def dim0_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, rows) of `rank` under torch.chunk(n rows, world), the split FSDP2 uses."""
    chunk = -(-n // world) if n else 0
    offset = min(rank * chunk, n)
    return offset, min(chunk, n - offset)


@dataclass(frozen=True, slots=True)
class Ownership:
    offset: int  # first canonical row this rank holds
    rows: int  # rows it holds
    global_shape: tuple[int, ...]
    writes: bool  # whether this rank's copy goes into the checkpoint


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def ownership(name: str, t: torch.Tensor, layout: ParallelLayout) -> Ownership:
    """Which canonical rows of tensor `name` (a parameter or its optimizer moment) this rank holds."""
    if ".experts.master." in name:
        epn = t.shape[0]
        return Ownership(offset=layout.ep_rank * epn, rows=epn, global_shape=(epn * layout.ep, *t.shape[1:]),
                         writes=layout.dp_replicate_rank == 0)
    if isinstance(t, DTensor):
        assert t.placements == (Shard(0),) and t.device_mesh.ndim == 1, (name, t.placements)
        mesh = t.device_mesh
        offset, rows = dim0_rows(t.shape[0], mesh.size(), mesh.get_local_rank())
        assert t.to_local().shape[0] == rows, (name, t.to_local().shape, rows)
        return Ownership(offset=offset, rows=rows, global_shape=tuple(t.shape), writes=rows > 0)
    shape = tuple(t.shape)
    return Ownership(offset=0, rows=shape[0] if shape else 0, global_shape=shape, writes=layout.rank == 0)


def expert_shard_ownership(t: torch.Tensor, layout: ParallelLayout) -> Ownership:
    """The canonical rows of a sharded expert master (ExpertWeights.shard_state) or of its optimizer moments."""
    rows = t.shape[0]
    epn = rows * layout.dp_replicate
    return Ownership(offset=layout.ep_rank * epn + layout.dp_replicate_rank * rows, rows=rows,
                     global_shape=(epn * layout.ep, *t.shape[1:]), writes=True)


def file_sha256(path: Path, block_bytes: int = 1 << 24) -> str:
    """The sha256 of a file; the read of the next block overlaps the hash of this one (hashlib releases the GIL)."""
    h = hashlib.sha256()
    blocks = [bytearray(block_bytes), bytearray(block_bytes)]
    with path.open("rb", buffering=0) as fh, ThreadPoolExecutor(1) as pool:
        hashing, k = None, 0
        while True:
            n = fh.readinto(blocks[k % 2])  # this block was last hashed two rounds ago: done
            if hashing is not None:
                hashing.result()
            if not n:
                return h.hexdigest()
            hashing = pool.submit(h.update, memoryview(blocks[k % 2])[:n])
            k += 1


@dataclass(frozen=True, slots=True)
class Piece:
    file: str
    offset: int
    rows: int


class TensorSource:
    """Row ranges of canonical tensors spread over safetensors files of one directory.

    index: name -> (global shape, pieces). Files are checked against `expected` (the manifest's entries:
    bytes, and block_bytes with block_sha256 or one whole-file sha256) on first use, so a missing, truncated
    or altered file is reported by name before any value is read; each piece against the file's own header
    (it must hold the tensor as exactly the piece's rows), so no read reaches past a tensor.
    """

    def __init__(self, root: Path, index: dict[str, tuple[tuple[int, ...], list[Piece]]],
                 expected: dict[str, dict] | None = None, *, verified: bool = False) -> None:
        """verified: the files' digests were checked already (resume.resolve_resume); sizes are still checked."""
        self.root, self.index, self.expected, self.verified = root, index, expected, verified
        self._open: dict[str, SafetensorsReader] = {}

    def names(self) -> list[str]:
        return list(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        if halves := self._separate_gate_up(name):
            shape = self._entry(halves[0])[0]
            return (*shape[:-1], 2 * shape[-1]) if shape else ()  # 0-d: the halves' step count, one value
        return self._entry(name)[0]

    def full(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 0)

    def rows(self, name: str, offset: int, rows: int) -> torch.Tensor:
        """Canonical rows [offset, offset + rows) of `name` (the whole tensor when it is 0-d), in the saved dtype."""
        if halves := self._separate_gate_up(name):
            if not self.shape(halves[0]):
                return self.rows(halves[0], offset, rows)
            return torch.cat([self.rows(half, offset, rows) for half in halves], dim=-1)
        shape, pieces = self._entry(name)
        dtype = self._reader(pieces[0], name, shape).entries[name][0] if pieces else torch.get_default_dtype()
        out = torch.empty((rows, *shape[1:]) if shape else (), dtype=dtype)
        self.read_into(name, offset, rows, out)
        return out

    def read_into(self, name: str, offset: int, rows: int, out: torch.Tensor) -> None:
        """Canonical rows [offset, offset + rows) of `name` (the whole tensor when it is 0-d) into `out`, a tensor
        of their shape on any device: each piece is read straight into its rows of `out`
        (SafetensorsReader.read_into)."""
        if self._separate_gate_up(name):
            out.copy_(self.rows(name, offset, rows))
            return
        shape, pieces = self._entry(name)
        if not shape:
            self._reader(pieces[0], name, shape).read_into(name, 0, 0, out)
            return
        if offset + rows > shape[0]:
            raise CheckpointError(f"{self.root}: {name} has {shape[0]} rows, rows [{offset}, {offset + rows}) "
                                  "were asked for; the model does not match the checkpoint")
        covered = offset
        for piece in sorted(pieces, key=lambda p: p.offset):
            lo, hi = max(covered, piece.offset), min(offset + rows, piece.offset + piece.rows)
            if lo > covered or hi <= lo:
                continue
            self._reader(piece, name, shape).read_into(name, lo - piece.offset, hi - piece.offset,
                                                       out[lo - offset:hi - offset])
            covered = hi
        if covered != offset + rows:
            raise CheckpointError(f"{self.root}: rows [{covered}, {offset + rows}) of {name} are in no file of "
                                  f"the checkpoint (pieces {[(p.file, p.offset, p.rows) for p in pieces]})")

    def verify(self, file: str) -> None:
        """Check one file against the manifest now (missing, size, digests); raises CheckpointError."""
        self._handle(file)

    def _separate_gate_up(self, name: str) -> tuple[str, str] | None:
        """A checkpoint saved before the experts' gate and up became one projection (ExpertWeights) holds
        `...experts.master.gate` and `...up` (and their optimizer states) instead of `...gate_up`: their names,
        read as the column halves of gate_up [E, H, 2F] (AdamW's and Muon's per-half states are the same values)."""
        halves = separate_gate_up_names(name)
        if halves is None or name in self.index:
            return None
        return halves if all(h in self.index for h in halves) else None

    def _entry(self, name: str) -> tuple[tuple[int, ...], list[Piece]]:
        if name not in self.index:
            raise CheckpointError(f"{self.root}: no tensor {name!r} in the checkpoint; the model does not match it")
        return self.index[name]

    def _reader(self, piece: Piece, name: str, shape: tuple[int, ...]) -> SafetensorsReader:
        """The reader of the piece's file, once its header agrees with the manifest: the file holds `name` as
        exactly the piece's rows, so no read of the piece can reach past the tensor (into another one)."""
        reader = self._handle(piece.file)
        held = reader.entries.get(name)
        want = (piece.rows, *shape[1:]) if shape else ()
        if held is None or held[1] != want:
            raise CheckpointError(f"checkpoint file {reader.path} does not match the manifest: its header has "
                                  f"{name!r} as {list(held[1]) if held else 'nothing'}, the manifest's piece "
                                  f"{[piece.file, piece.offset, piece.rows]} of shape {list(shape)} needs {list(want)}; "
                                  f"{RESTORE}")
        return reader

    def _handle(self, file: str) -> SafetensorsReader:
        if file not in self._open:
            path = self.root / file
            if self.expected is not None:
                verify_file(path, self.expected[file], digests=not self.verified)
            elif not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing")
            try:
                self._open[file] = SafetensorsReader(path)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"checkpoint file {path} is not a readable safetensors file: {err}") from err
        return self._open[file]


def verify_file(path: Path, want: dict, *, digests: bool = True) -> None:
    """Check a checkpoint file against its manifest entry: present, its size, and (digests) its content."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {size} bytes, the manifest says {want['bytes']}")
    if digests:
        _verify(path, want)


def _verify(path: Path, want: dict) -> None:
    """Check a file against its manifest entry: its block digests (on several threads), or one sha256."""
    if "block_sha256" in want:
        bad = first_bad_block(path, want["block_sha256"], want["block_bytes"])
        if bad is not None:
            lo = bad * want["block_bytes"]
            raise CheckpointError(f"checkpoint file {path} is corrupt: block {bad} (bytes [{lo}, "
                                  f"{min(lo + want['block_bytes'], want['bytes'])})) differs from the manifest's "
                                  f"sha256; {RESTORE}")
    elif file_sha256(path) != want["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its sha256 differs from the manifest; {RESTORE}")
