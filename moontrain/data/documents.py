"""The documents of one file source, in a fixed global order: text, pre-tokenized ids, or flat token blocks.

Text and pre-tokenized documents come through Hugging Face `datasets` (nothing is downloaded): the
packaged json / parquet / text builders read local files, a directory written by `Dataset.save_to_disk`
is opened with `load_from_disk`. A source whose rows have the `ids_field` column (`input_ids`) is
pre-tokenized: its documents are id lists and no tokenizer runs. Text files are one document per file
(`text_unit: file`) or per line (`line`). Map-style (the default) memory-maps an Arrow cache and gives
random access, so every epoch can have its own order.

Streaming (`data.streaming`, StreamedFiles) reads jsonl / parquet / text files lazily in their order, with
no cache, and decodes only the documents of the rank's share (every `stride`-th from a start): other
jsonl / text lines are skipped unparsed, parquet row groups without a document of the share are not
read, text files of other ranks are not opened. Lines are split at "\n" / "\r\n" (the map-style text
builder also splits at the rarer Unicode line separators). A save_to_disk directory is memory-mapped,
so it is always read by index.

A flat token file (`.bin`: raw uint16/uint32, the nanoGPT / Megatron convention; `.npy`: its own dtype) is
memory-mapped and cut into blocks of `seq_len` tokens, the "documents" of the order; a file's last block
may be shorter. Its documents already hold their end-of-document tokens, so the packer adds none.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moontrain.data.config import SourceConfig

_BUILDERS = {"jsonl": "json", "parquet": "parquet", "text": "text"}
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text", ".bin": "tokens",
             ".npy": "tokens"}

Document = str | list[int] | np.ndarray


def _data_files(path: str) -> list[str]:
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.suffix in _SUFFIXES)
    else:
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if p.is_file() else [])
    if not files:
        raise ValueError(f"data path {path!r} names no file; give a jsonl/parquet/text/.bin/.npy file, a directory or "
                         "glob of them, or a save_to_disk directory")
    return files


def _format(src: SourceConfig) -> str:
    if src.format != "auto":
        return src.format
    p = Path(src.path)
    if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()):
        return "saved"
    suffixes = {Path(f).suffix for f in _data_files(src.path)}
    kinds = {_SUFFIXES.get(s) for s in suffixes}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"data path {src.path!r}: cannot tell the format from the suffixes {sorted(suffixes)}; "
                         f"set its format to one of jsonl, parquet, text, saved, tokens")
    return kinds.pop()


class Documents:
    """Documents of one source with random access: `len()` and `get(index)`; `pretokenized` says whether they
    are id lists (no tokenizer) and `has_eos` whether they carry their own end-of-document."""

    streaming = False

    def __init__(self, src: SourceConfig) -> None:
        import datasets

        datasets.disable_progress_bars()
        fmt = _format(src)
        if fmt == "saved":
            if not Path(src.path).is_dir():
                raise ValueError(f"data path {src.path!r} is not a directory written by Dataset.save_to_disk")
            ds = datasets.load_from_disk(src.path)
            if isinstance(ds, datasets.DatasetDict):
                raise ValueError(f"data path {src.path!r} holds splits {list(ds)}; point it at one split's directory")
        else:
            kwargs = {"sample_by": "document" if src.text_unit == "file" else "line"} if fmt == "text" else {}
            ds = datasets.load_dataset(_BUILDERS[fmt], data_files=_data_files(src.path), split="train", **kwargs)
        self.field, self.pretokenized = _field(src, fmt, ds.column_names)
        self.ds, self.path, self.has_eos = ds, src.path, False
        if len(ds) == 0:
            raise ValueError(f"data path {src.path!r} holds no documents")

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, index: int) -> Document:
        return self.ds[index][self.field]


def _field(src: SourceConfig, fmt: str, columns: list[str]) -> tuple[str, bool]:
    """(the column to read, whether it holds ids): ids_field when present, else text_field."""
    if fmt == "text":
        return "text", False
    if src.ids_field in columns:
        return src.ids_field, True
    if src.text_field not in columns:
        raise ValueError(f"text_field={src.text_field!r} is not a column of {src.path!r}; columns: {columns} (a "
                         f"pre-tokenized source has an {src.ids_field!r} column)")
    return src.text_field, False


class StreamedFiles:
    """jsonl / parquet / text files read lazily in file order, decoding only every stride-th document."""

    streaming, has_eos = True, False

    def __init__(self, src: SourceConfig, fmt: str) -> None:
        import pyarrow.parquet as pq

        self.files, self.fmt, self.path, self.per_file = _data_files(src.path), fmt, src.path, src.text_unit == "file"
        if fmt == "parquet":
            columns = pq.ParquetFile(self.files[0]).schema_arrow.names
        elif fmt == "jsonl":
            columns = list(json.loads(next(line for line in _lines(self.files[0]) if line.strip())))
        else:
            columns = ["text"]
        self.field, self.pretokenized = _field(src, fmt, columns)

    def iter_from(self, index: int, stride: int) -> Iterator[tuple[int, Document]]:
        """(global index, document) for the documents index, index + stride, ... to the end of the files."""
        g = 0  # global index of the next document of the files
        for f in self.files:
            if self.fmt == "parquet":
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(f)
                for rg in range(pf.num_row_groups):
                    n = pf.metadata.row_group(rg).num_rows
                    first = _first_of_share(max(g, index), index, stride)
                    if first < g + n:
                        column = pf.read_row_group(rg, columns=[self.field]).column(0)
                        for j in range(first, g + n, stride):
                            yield j, column[j - g].as_py()
                    g += n
            elif self.fmt == "text" and self.per_file:
                if g >= index and (g - index) % stride == 0:
                    yield g, Path(f).read_text(encoding="utf-8")
                g += 1
            else:
                for line in _lines(f):
                    if self.fmt == "jsonl" and not line.strip():
                        continue
                    if g >= index and (g - index) % stride == 0:
                        yield g, json.loads(line)[self.field] if self.fmt == "jsonl" else line.rstrip("\r\n")
                    g += 1


def _lines(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8", newline="") as fh:
        yield from fh


def _first_of_share(at: int, index: int, stride: int) -> int:
    """The first document >= at of the share index, index + stride, ..."""
    return index + -(-(at - index) // stride) * stride


class TokenBlocks:
    """A flat token file (or several, in name order) as blocks of `block` tokens; random access through mmap."""

    pretokenized, has_eos, streaming = True, True, False

    def __init__(self, src: SourceConfig, *, block: int) -> None:
        self.path, self.block = src.path, block
        self.files = []
        for f in _data_files(src.path):
            if f.endswith(".npy"):
                arr = np.load(f, mmap_mode="r")
                if arr.ndim != 1 or arr.dtype.kind not in "iu":
                    raise ValueError(f"token file {f} holds {arr.dtype} of shape {arr.shape}; a flat token file is "
                                     "one-dimensional integers")
            else:
                arr = np.memmap(f, dtype=np.dtype(src.token_dtype), mode="r")
            self.files.append(arr)
        self.starts = np.cumsum([0] + [-(-len(a) // block) for a in self.files])  # first block index of each file
        if self.starts[-1] == 0:
            raise ValueError(f"data path {src.path!r} holds no tokens")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, index: int) -> np.ndarray:
        f = int(np.searchsorted(self.starts, index, side="right")) - 1
        i = index - int(self.starts[f])
        return np.asarray(self.files[f][i * self.block:(i + 1) * self.block], dtype=np.int64)



def open_documents(src: SourceConfig, *, streaming: bool, seq_len: int) -> Documents | TokenBlocks | StreamedFiles:
    fmt = _format(src)
    if fmt == "tokens":
        return TokenBlocks(src, block=seq_len)
    if streaming and fmt != "saved":
        return StreamedFiles(src, fmt)
    return Documents(src)
