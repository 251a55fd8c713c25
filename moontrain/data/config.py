"""Token source configuration: the synthetic Markov chain, or documents from local files via HF datasets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["markov", "dataset"] = "markov"
    seed: int = 1234  # markov: the chain and its walks; dataset: the per-epoch document order
    branching: int = 2  # markov: each token has this many likely successors (achievable loss ~log(branching))
    # dataset: a file, a directory of files, a glob, or a directory written by Dataset.save_to_disk
    path: str | None = None
    format: Literal["auto", "jsonl", "parquet", "text", "saved"] = "auto"  # auto: from the suffix / directory
    text_field: str = "text"  # jsonl / parquet / saved: the column holding the document text
    tokenizer: Literal["bytes"] = "bytes"  # UTF-8 bytes 0..255 plus an end-of-document token 256
    streaming: bool = False  # read files lazily (large inputs); documents keep the file order
    shuffle: bool = True  # a new document order every epoch (not with streaming)

    def __post_init__(self) -> None:
        if self.branching < 1:
            raise ValueError(f"data.branching must be >= 1, got {self.branching}")
        if self.source == "dataset" and not self.path:
            raise ValueError("data.source=dataset needs data.path (a jsonl/parquet/text file, a directory or glob of "
                             "them, or a save_to_disk directory), e.g. data.path=recipes/data/tiny_corpus.jsonl")
        if self.streaming and self.shuffle:
            raise ValueError("data.streaming=true reads documents in file order; set data.shuffle=false with it")
