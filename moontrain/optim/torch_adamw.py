"""torch's AdamW under the training step's optimizer contract (moontrain/optim/protocol.py).

A fused one folds the global-norm clip into its step: `clip_next_step` sets torch's `grad_scale` (the AMP
hook of the fused Adam kernels, which divides each grad by it inside the kernel) and step() removes it
again, so the factor applies to that step only. Likewise `skip_next_step_if` sets torch's `found_inf` (the
kernel leaves parameters and moments as they were where it is 1, and the step counts are taken back), so a
non-finite step is skipped on the device. Nothing is written back: `written_back` is empty.
"""

from __future__ import annotations

import torch


class AdamW(torch.optim.AdamW):
    @property
    def folds_clip(self) -> bool:
        return bool(self.defaults.get("fused"))

    def clip_next_step(self, factor: torch.Tensor) -> None:
        if not self.folds_clip:
            raise ValueError("clip_next_step needs a fused optimizer (optim.fused=true): torch's foreach AdamW "
                             "has no grad_scale hook; scale the grads instead")
        self.grad_scale = factor

    @property
    def skips_on_device(self) -> bool:
        return bool(self.defaults.get("fused"))

    def skip_next_step_if(self, found_inf: torch.Tensor) -> None:
        if not self.skips_on_device:
            raise ValueError("skip_next_step_if needs a fused optimizer (optim.fused=true): torch's foreach AdamW "
                             "has no found_inf hook; read the verdict on the host instead")
        self.found_inf = found_inf

    @property
    def written_back(self) -> frozenset[int]:
        return frozenset()

    def step(self, closure=None):
        try:
            return super().step(closure)
        finally:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
