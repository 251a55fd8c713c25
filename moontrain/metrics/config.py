"""Metrics configuration: the wandb run (the console line and metrics.jsonl are always written)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    wandb: bool = True
    # offline: the run is written under <run_dir>/wandb and can be synced later (`wandb sync`);
    # a WANDB_MODE environment variable, when set, takes precedence (wandb's own convention)
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "moontrain"
    run_name: str | None = None  # default: the name of train.run_dir
