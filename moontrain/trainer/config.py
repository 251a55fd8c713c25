"""Training-loop configuration: steps, batch geometry, logging, run directory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int
    global_batch_size: int  # sequences per optimizer step over all ranks
    seq_len: int
    seed: int = 0
    log_every: int = 1
    run_dir: str = "runs/default"
    activation_checkpointing: bool = False  # recompute every block in backward (saves its activations)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
