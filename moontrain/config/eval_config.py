"""The eval: section (EvalConfig): how often, how much, and which held-out data."""

from __future__ import annotations

from dataclasses import dataclass

from moontrain.data.config import SourceConfig


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0  # evaluate every this many steps and after the last one (0: never); a multiple of train.log_every
    steps: int = 4  # batches of train.global_batch_size sequences of train.seq_len per evaluation
    # held-out documents or tokens (the options of one data source; read with data.tokenizer)
    data: SourceConfig | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0 (0: no evaluation), got {self.every}")
        if self.steps < 1:
            raise ValueError(f"eval.steps must be >= 1, got {self.steps}")
        if self.every and self.data is None:
            raise ValueError(f"eval.every={self.every} needs held-out data: eval.data.path=FILE (a jsonl / parquet / "
                             "text / .bin file like data.path)")
