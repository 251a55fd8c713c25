"""Metrics configuration: the wandb run (the console line and metrics.jsonl are always written)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    wandb: bool = True  # log to a wandb run under <run_dir>/wandb
    # offline: the run is written under <run_dir>/wandb and can be synced later (`wandb sync`);
    # a WANDB_MODE environment variable, when set, takes precedence (wandb's own convention)
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "moontrain"  # the wandb project
    run_name: str | None = None  # default: the name of train.run_dir
    # expert-load heatmap (moontrain.metrics.heatmap): a PNG under <run_dir>/heatmaps and a wandb image every
    # this many logging steps (and at the last step), over the steps since the previous one; 0: none
    heatmap_every: int = 10

    def __post_init__(self) -> None:
        if self.heatmap_every < 0:
            raise ValueError(f"metrics.heatmap_every must be >= 0 (0: no heatmaps), got {self.heatmap_every}")
