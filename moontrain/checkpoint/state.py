"""TrainState: everything a checkpoint saves and restores, as one object the trainer owns.

The checkpoint functions (store.py, hf.py) take this, never the trainer, so the checkpoint package
depends on the pieces of a run and not on the loop that drives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moontrain.data.source import TokenSource
    from moontrain.model.config import ModelConfig
    from moontrain.model.experts.weights import ExpertWeights
    from moontrain.optim.config import OptimConfig
    from moontrain.optim.protocol import TrainOptimizer
    from moontrain.parallel.layout import ParallelLayout


@dataclass(kw_only=True, eq=False)
class TrainState:
    """model / optimizer / scheduler / data are the live objects (restored in place); step, tokens_seen
    and wandb_run_id are plain values (restored by assignment). model_config, experts_backend and
    data_source are what a checkpoint must agree with to be loaded (the model's shapes, the data position's
    meaning); optim_config, schedule_steps (the steps the LR schedule spans), tokenizer (the record of
    data.tokenizer, None for synthetic tokens: checkpoint.run_tokenizer) and seeds are recorded beside them.
    experts: the model's ExpertWeights, whose compute copies follow their masters after a load.
    The RNG state saved is the process's (torch's CPU and CUDA generators)."""

    layout: ParallelLayout
    model: nn.Module
    optimizer: TrainOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: TokenSource
    experts: list[ExpertWeights]
    model_config: ModelConfig
    optim_config: OptimConfig  # saved so that a resume can name the settings the recipe changed
    experts_backend: str
    data_source: str
    schedule_steps: int
    tokenizer: dict[str, Any] | None
    seeds: dict[str, int] = field(default_factory=dict)  # "train.seed" / "data.seed": a resume must keep them
    step: int = 0
    tokens_seen: int = 0
    wandb_run_id: str | None = None  # set by the worker (rank 0)
