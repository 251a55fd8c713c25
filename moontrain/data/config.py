"""Token source configuration: the synthetic Markov chain, or documents / tokens from local files.

One file source is given inline (data.path, data.format, ...); a mixture names several under data.sources
(`data.sources.web.path=...`, `data.sources.web.weight=0.7`), each a `SourceConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FileFormat = Literal["auto", "jsonl", "parquet", "text", "saved", "tokens"]


@dataclass(kw_only=True, slots=True)
class SourceConfig:
    """One file source: documents (text or pre-tokenized input_ids) or a flat token file."""

    # a file, a directory of files, a glob, or a directory written by Dataset.save_to_disk
    path: str
    weight: float = 1.0  # mixtures: this source's share of the training tokens (normalised over the sources)
    # auto: from the suffix (.jsonl/.json, .parquet, .txt, .bin/.npy = tokens) or a save_to_disk directory
    format: FileFormat = "auto"
    text_field: str = "text"  # jsonl / parquet / saved: the column holding the document text
    ids_field: str = "input_ids"  # pre-tokenized input: when this column exists it is read, no tokenizer runs
    text_unit: Literal["file", "line"] = "file"  # text files: one document per file, or per line
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # tokens (.bin): the element type (.npy carries its own)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("a data source needs a path (a jsonl/parquet/text/.bin/.npy file, a directory or glob of "
                             "them, or a save_to_disk directory)")
        if not self.weight > 0:
            raise ValueError(f"data source {self.path!r}: weight must be > 0, got {self.weight}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["markov", "dataset"] = "markov"  # markov: synthetic tokens; dataset: files (path or sources)
    seed: int = 1234  # markov: the chain and its walks; dataset: document orders and the mixture's draws
    branching: int = 2  # markov: each token has this many likely successors (achievable loss ~log(branching))
    # dataset, one source (the fields of SourceConfig); or data.sources for a mixture
    path: str | None = None
    format: FileFormat = "auto"  # as SourceConfig.format
    text_field: str = "text"  # as SourceConfig.text_field
    ids_field: str = "input_ids"  # as SourceConfig.ids_field
    text_unit: Literal["file", "line"] = "file"  # as SourceConfig.text_unit
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # as SourceConfig.token_dtype
    sources: dict[str, SourceConfig] = field(default_factory=dict)  # name -> source: a weighted mixture
    # `bytes` (UTF-8 bytes + EOS 256) or a local Hugging Face tokenizer: a tokenizer.json file or a directory
    tokenizer: str = "bytes"
    eos_id: int | None = None  # the id put between documents; None: the tokenizer's end-of-text token
    streaming: bool = False  # read files lazily (large inputs); documents keep the file order
    shuffle: bool = True  # a new document order every epoch (not with streaming)
    prefetch: int = 4  # batches prepared ahead by a background thread (0: on the training thread)

    def __post_init__(self) -> None:
        if self.branching < 1:
            raise ValueError(f"data.branching must be >= 1, got {self.branching}")
        if self.source == "dataset" and not self.path and not self.sources:
            raise ValueError("data.source=dataset needs data.path (a jsonl/parquet/text/.bin file, a directory or glob "
                             "of them, or a save_to_disk directory), e.g. data.path=recipes/data/tiny_corpus.jsonl, "
                             "or a mixture under data.sources")
        if self.path and self.sources:
            raise ValueError(f"data.path={self.path!r} and data.sources {sorted(self.sources)} are both set; give one "
                             "source as data.path or all of them under data.sources")
        if self.streaming and self.shuffle:
            raise ValueError("data.streaming=true reads documents in file order; set data.shuffle=false with it")
        if self.prefetch < 0:
            raise ValueError(f"data.prefetch must be >= 0 (0: no background thread), got {self.prefetch}")

    def file_sources(self) -> dict[str, SourceConfig]:
        """name -> source; one inline source is named `data`."""
        if self.sources:
            return dict(self.sources)
        assert self.path is not None
        return {"data": SourceConfig(path=self.path, format=self.format, text_field=self.text_field,
                                     ids_field=self.ids_field, text_unit=self.text_unit, token_dtype=self.token_dtype)}
