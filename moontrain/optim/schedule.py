"""Learning-rate multipliers: linear warmup, then cosine, WSD (warmup-stable-decay) or constant.

`step` is the number of optimizer steps already taken (LambdaLR's convention), so step 0 uses the
first warmup value 1/warmup_steps rather than 0 (a zero-lr first step would waste a batch).
"""

from __future__ import annotations

import math

from moontrain.optim.config import OptimConfig


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd: hold at the peak, then decay linearly to the floor over the last decay_fraction of the steps
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    return 1.0 - (1.0 - floor) * progress
