"""The optimizer contract of the training step: what Trainer.train_step and the global-norm clip ask of
the optimizer beyond torch.optim.Optimizer's step / zero_grad / state_dict.

- `folds_clip`: True when step() can divide every grad by a clip factor itself (torch's fused AdamW
  kernel through its `grad_scale` hook; the write-back kernel). The clip then saves its own pass over
  the grads (parallel/clip.py).
- `clip_next_step(factor)`: the next step() divides every grad by `factor` (a device scalar >= 1) and
  then forgets it: the factor never outlives its step. Only valid when `folds_clip`.
- `written_back`: the ids of the expert masters whose compute copies the last step() already wrote
  (and whose grads it zeroed unless their backend defers zeroing); ExpertWeights.finish_step skips them.

Every optimizer build_optimizer returns satisfies it (moontrain.optim.adamw.AdamW, WriteBackAdamW); a
new optimizer implements these three members and is checked by tests/moontrain/optim/test_optim.py.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainOptimizer(Protocol):
    param_groups: list[dict]

    @property
    def folds_clip(self) -> bool: ...

    def clip_next_step(self, factor: torch.Tensor) -> None: ...

    @property
    def written_back(self) -> frozenset[int]: ...

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
