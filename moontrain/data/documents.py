"""The documents of one file source, in a fixed global order: text, pre-tokenized ids, or flat token blocks.

Text and pre-tokenized documents come through Hugging Face `datasets` (nothing is downloaded): the
packaged json / parquet / text builders read local files, a directory written by `Dataset.save_to_disk`
is opened with `load_from_disk`. A source whose rows have the `ids_field` column (`input_ids`) is
pre-tokenized: its documents are id lists and no tokenizer runs. Text files are one document per file
(`text_unit: file`) or per line (`line`). Map-style (the default) memory-maps an Arrow cache and gives
random access, so every epoch can have its own order. Streaming (`data.streaming`) reads the files lazily
in their order: large inputs start at once and use no cache.

A flat token file (`.bin`: raw uint16/uint32, the nanoGPT / Megatron convention; `.npy`: its own dtype) is
memory-mapped and cut into blocks of `seq_len` tokens, the "documents" of the order; a file's last block
may be shorter. Its documents already hold their end-of-document tokens, so the packer adds none.
"""

from __future__ import annotations

import glob
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
    """Documents of one source: `len()` (map-style), `get(index)` and `iter_from(index)`; `pretokenized` says
    whether they are id lists (no tokenizer) and `has_eos` whether they carry their own end-of-document."""

    def __init__(self, src: SourceConfig, *, streaming: bool) -> None:
        import datasets

        datasets.disable_progress_bars()
        fmt = _format(src)
        if fmt == "saved":
            if not Path(src.path).is_dir():
                raise ValueError(f"data path {src.path!r} is not a directory written by Dataset.save_to_disk")
            ds = datasets.load_from_disk(src.path)
            if isinstance(ds, datasets.DatasetDict):
                raise ValueError(f"data path {src.path!r} holds splits {list(ds)}; point it at one split's directory")
            ds = ds.to_iterable_dataset() if streaming else ds
        else:
            kwargs = {"sample_by": "document" if src.text_unit == "file" else "line"} if fmt == "text" else {}
            ds = datasets.load_dataset(_BUILDERS[fmt], data_files=_data_files(src.path), split="train",
                                       streaming=streaming, **kwargs)
        columns = ds.column_names
        if fmt == "text":
            field = "text"
        elif columns is not None and src.ids_field in columns:
            field = src.ids_field
        else:
            field = src.text_field
        if columns is not None and field not in columns:
            raise ValueError(f"text_field={field!r} is not a column of {src.path!r}; columns: {columns} (a "
                             f"pre-tokenized source has an {src.ids_field!r} column)")
        self.ds, self.field, self.streaming, self.path = ds, field, streaming, src.path
        self.pretokenized = field == src.ids_field and fmt != "text"
        self.has_eos = False
        if not streaming and len(ds) == 0:
            raise ValueError(f"data path {src.path!r} holds no documents")

    def __len__(self) -> int:
        assert not self.streaming, "a streaming dataset has no length"
        return len(self.ds)

    def get(self, index: int) -> Document:
        return self.ds[index][self.field]

    def iter_from(self, index: int) -> Iterator[tuple[int, Document]]:
        """(global index, document) from document `index` on, in file order (streaming)."""
        for i, row in enumerate(self.ds.skip(index) if index else self.ds, start=index):
            yield i, row[self.field]


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

    def iter_from(self, index: int) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(index, len(self)):
            yield i, self.get(i)


def open_documents(src: SourceConfig, *, streaming: bool, seq_len: int) -> Documents | TokenBlocks:
    if _format(src) == "tokens":
        return TokenBlocks(src, block=seq_len)
    return Documents(src, streaming=streaming)
