"""Token source configuration (the in-memory synthetic source; real datasets come with issue 6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["markov"] = "markov"
    seed: int = 1234
    branching: int = 2  # each token has this many likely successors: the achievable loss is ~log(branching)

    def __post_init__(self) -> None:
        if self.branching < 1:
            raise ValueError(f"data.branching must be >= 1, got {self.branching}")
