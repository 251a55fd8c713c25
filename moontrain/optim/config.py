"""Optimizer and learning-rate schedule configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    fused: bool | None = None  # torch's fused AdamW kernels; None: on when the parameters are on a GPU
    # expert masters: one Triton pass per projection for the AdamW step, the compute-copy write and the
    # grad zeroing (moontrain.optim.write_back); None: on when `fused` is on
    write_back: bool | None = None

    def __post_init__(self) -> None:
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if not 0 < self.eps < math.inf:
            raise ValueError(f"optim.eps must be a finite number > 0 (AdamW divides by sqrt(v) + eps; 1e-8 is usual), "
                             f"got {self.eps}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optim.weight_decay must be a finite number >= 0 (0 disables), got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.grad_clip < math.inf:
            raise ValueError(f"optim.grad_clip must be a finite number >= 0 (0 disables), got {self.grad_clip}")
