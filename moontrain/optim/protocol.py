"""The optimizer contract of the training step: what Trainer.train_step and the global-norm clip ask of
the optimizer beyond torch.optim.Optimizer's step / zero_grad / state_dict.

- `folds_clip`: True when step() can divide every grad by a clip factor itself (torch's fused AdamW
  kernel through its `grad_scale` hook; the write-back kernel). The clip then saves its own pass over
  the grads (parallel/clip.py).
- `clip_next_step(factor)`: the next step() divides every grad by `factor` (a device scalar >= 1) and
  then forgets it: the factor never outlives its step. Only valid when `folds_clip`.
- `written_back`: the ids of the expert masters whose compute copies the last step() already wrote
  (and whose grads it zeroed unless their backend defers zeroing); ExpertWeights.finish_step skips them.
- `skips_on_device`: True when step() can leave every parameter and its state (moments, step counts) as
  they were on a device flag, without a host read (torch's fused AdamW kernel through its `found_inf`
  hook, the AMP one; the write-back kernel). The trainer then never waits for the step's verdict
  before the update (moontrain.trainer.guard).
- `skip_next_step_if(found_inf)`: the next step() changes nothing it steps when the float32 device scalar
  `found_inf` is 1 (and steps as usual when it is 0), then forgets it. Only valid when `skips_on_device`.

Every optimizer build_optimizer returns satisfies it (moontrain.optim.adamw.AdamW, WriteBackAdamW); a
new optimizer implements these five members and is checked by tests/moontrain/optim/test_optim.py.
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
    def skips_on_device(self) -> bool: ...

    def skip_next_step_if(self, found_inf: torch.Tensor) -> None: ...

    @property
    def written_back(self) -> frozenset[int]: ...

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
