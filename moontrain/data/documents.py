"""Documents from local files through Hugging Face `datasets`: jsonl, parquet, text, or a saved dataset.

Nothing is downloaded: the packaged json/parquet/text builders read local files, and a directory written
by `Dataset.save_to_disk` is opened with `load_from_disk`. Map-style (the default) memory-maps an Arrow
cache and gives random access, so every epoch can have its own order. Streaming (`data.streaming`)
reads the files lazily in their order: large inputs start at once and use no cache; resuming skips the
documents already read (a scan, not a seek).
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

import datasets

from moontrain.data.config import DataConfig

_BUILDERS = {"jsonl": "json", "parquet": "parquet", "text": "text"}
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text"}


def _data_files(path: str) -> list[str]:
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.suffix in _SUFFIXES)
    else:
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if p.is_file() else [])
    if not files:
        raise ValueError(f"data.path={path!r} names no file; give a jsonl/parquet/text file, a directory or glob of "
                         "them, or a save_to_disk directory")
    return files


def _format(cfg: DataConfig, path: str) -> str:
    if cfg.format != "auto":
        return cfg.format
    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()):
        return "saved"
    suffixes = {Path(f).suffix for f in _data_files(path)}
    kinds = {_SUFFIXES.get(s) for s in suffixes}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"data.path={path!r}: cannot tell the format from the suffixes {sorted(suffixes)}; "
                         f"set data.format to one of jsonl, parquet, text, saved")
    return kinds.pop()


class Documents:
    """The texts of a dataset in a fixed global order: `len()` (map-style) and `iter_from(index)`."""

    def __init__(self, cfg: DataConfig) -> None:
        assert cfg.path is not None
        datasets.disable_progress_bars()
        fmt = _format(cfg, cfg.path)
        if fmt == "saved":
            if not Path(cfg.path).is_dir():
                raise ValueError(f"data.path={cfg.path!r} is not a directory written by Dataset.save_to_disk")
            ds = datasets.load_from_disk(cfg.path)
            if isinstance(ds, datasets.DatasetDict):
                raise ValueError(f"data.path={cfg.path!r} holds splits {list(ds)}; point data.path at one split's "
                                 "directory")
            ds = ds.to_iterable_dataset() if cfg.streaming else ds
        else:
            ds = datasets.load_dataset(_BUILDERS[fmt], data_files=_data_files(cfg.path), split="train",
                                       streaming=cfg.streaming)
        field = "text" if fmt == "text" else cfg.text_field
        columns = ds.column_names
        if columns is not None and field not in columns:
            raise ValueError(f"data.text_field={field!r} is not a column of {cfg.path!r}; columns: {columns}")
        self.ds, self.field, self.streaming = ds, field, cfg.streaming
        if not cfg.streaming and len(ds) == 0:
            raise ValueError(f"data.path={cfg.path!r} holds no documents")

    def __len__(self) -> int:
        assert not self.streaming, "a streaming dataset has no length"
        return len(self.ds)

    def get(self, index: int) -> str:
        return self.ds[index][self.field]

    def iter_from(self, index: int) -> Iterator[tuple[int, str]]:
        """(global index, text) from document `index` on, in file order (streaming)."""
        for i, row in enumerate(self.ds.skip(index) if index else self.ds, start=index):
            yield i, row[self.field]
