"""The divergence policy and the per-step verdict every rank agrees on.

A step whose global grad norm is not finite (a NaN/Inf loss reaches it through its gradients) is
skipped: the optimizer does not step, so masters and Adam moments stay as they were, the grads are
dropped, and the skip is counted (`train/skipped_steps` in the metrics). The step still counts
(data, schedule and step number move on): it is a lost batch. After `train.max_skipped_steps`
skips in a row the run stops with DivergenceError; the checkpoints written so far are kept (every
skipped step leaves the weights as they were, and pruning never deletes the newest checkpoint whose
tensors are all finite, see moontrain.checkpoint).

The verdict is computed on the device after the grad norm: the norm is already reduced over the world
(identical on every rank), and the stop request of the preemption handler and the time-based save
(checkpoint.every_minutes, read on each rank's own clock) are reduced with it (MAX over ranks), so every
rank takes the same branch and no collective is left unmatched. An optimizer that skips on a device flag
(TrainOptimizer.skips_on_device: the fused AdamW) is handed the verdict's flag and stepped at once; the
trainer reads the verdict later (moontrain.metrics.host_read: after the next step's backward is queued
when Trainer.fit pipelines its steps), so the device never waits for the host between backward and
update. Other optimizers read it before the update (one host read, the device idle meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moontrain.parallel.layout import ParallelLayout


class DivergenceError(RuntimeError):
    """Raised when train.max_skipped_steps consecutive steps had a non-finite grad norm."""


@dataclass(frozen=True, slots=True)
class StepVerdict:
    finite: bool  # the global grad norm is finite: apply the optimizer step
    stop: bool  # some rank was asked to stop (preemption): save after this step and exit
    save: bool  # some rank's checkpoint interval has passed: save after this step

    @staticmethod
    def of(values: list[float]) -> StepVerdict:
        """From launch_verdict's values as read on the host."""
        finite, stop, save = values
        return StepVerdict(finite=finite == 1.0, stop=stop == 1.0, save=save == 1.0)


def launch_verdict(grad_norm: torch.Tensor, stop_requested: bool, layout: ParallelLayout,
                   save_due: bool = False) -> torch.Tensor:
    """Collective when distributed (one small all_reduce), no host read: float32 [finite, stop, save] on
    grad_norm's device. The flags are written by fill kernels (a host value copied into a device tensor
    would wait for the device's queue)."""
    flags = grad_norm.new_zeros((2,), dtype=torch.float32)
    for i, flag in enumerate((stop_requested, save_due)):
        if flag:
            flags[i].fill_(1.0)
    if layout.distributed:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=layout.world_group)
    return torch.cat([torch.isfinite(grad_norm).float().view(1), flags])


class DivergenceGuard:
    def __init__(self, max_skipped_steps: int) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.consecutive = 0
        self.total = 0

    def admit(self, finite: bool, step: int) -> bool:
        """True: apply this step's update. False: skip it. Raises after max_skipped_steps skips in a row."""
        if finite:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total += 1
        print(f"moontrain: step {step + 1}: non-finite grad norm, optimizer step skipped "
              f"({self.consecutive} in a row, at most {self.max_skipped_steps})", flush=True)
        if self.consecutive >= self.max_skipped_steps:
            raise DivergenceError(
                f"training diverged: {self.consecutive} consecutive steps (up to step {step + 1}) had a non-finite "
                f"loss or grad norm; the weights of the last finite step are untouched and the checkpoints kept. "
                f"Lower optim.lr, raise optim.warmup_steps or check optim.eps/grad_clip, then resume from the "
                f"last checkpoint (train.max_skipped_steps={self.max_skipped_steps} sets the tolerance)")
        return False
