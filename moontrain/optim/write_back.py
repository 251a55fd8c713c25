"""Fused AdamW step for the expert masters (and parallel.dense=plain's dense masters, optim.write_back_dense)
that also writes their compute copy and zeroes their grad (the dense accumulators are left as they are).

Per expert projection the step protocol after backward is AdamW (read p, g, m, v; write p, m, v), then
push_master (read p, write the bf16 compute rows) and zero_grads (write g): 34 bytes per parameter in
three passes, plus torch's fused kernel writing the clip-scaled grad back (4 more). One Triton pass
does it all: reads p, g, m, v, writes p, m, v, the compute copy and g = 0 (34 bytes; 30 for moonep,
whose next accumulation overwrites the grads: moonep.ExpertPools.defer_zero_grads), one launch per
parameter group (write_back_kernel's tables). On 2xH200 at
k3_small_moe (4.25B expert parameters per rank, 2026-11-29) the three passes took ~42 + 8 + 6 ms.

The math is torch's fused AdamW (ATen's fused_adam_utils, ADAMW mode), in fp32:
    g = g / grad_scale                       (when clip_next_step gave a clip factor, see clip.py)
    p = p - lr * wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
with the bias corrections computed on the device from the step tensors (no host read). With
skip_next_step_if's flag at 1 the pass keeps p, m and v (and the step counts) as they were: it still
writes the compute copy (of the unchanged p) and zeroes the grad. Values match
torch's AdamW up to fp32 contraction (a few ulps per step; tests/moontrain/optim/test_write_back_*).
State is torch's (exp_avg, exp_avg_sq, a float32 step tensor on the parameter's device), so
checkpoints and the optimizer's state_dict do not change; with optim.state_dtype=bfloat16 the moments are bf16
(moontrain.optim.torch_adamw: the same math, and the step of the parameters not written back).
"""

from __future__ import annotations

import torch

from moontrain.optim.torch_adamw import AdamW


class WriteBackAdamW(AdamW):
    """moontrain's AdamW, except for parameters registered with `register_write_back`: their step is
    `adamw_write_back_` (which also writes the registered compute tensor and zeroes the grad unless
    registered with zero_grad=False, then drops p.grad). `written_back` holds the ids of the
    parameters the last step wrote back. The kernel folds a clip factor in even where torch's
    unfused step could not, so `folds_clip` holds when every parameter is registered."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if self.defaults.get(flag):
                raise ValueError(f"WriteBackAdamW implements plain AdamW; {flag}=True is not supported")
        self._out: dict[int, torch.Tensor] = {}
        self._zero: dict[int, bool] = {}
        self._written: frozenset[int] = frozenset()

    @property
    def folds_clip(self) -> bool:
        registered = all(id(p) in self._out for group in self.param_groups for p in group["params"])
        return bool(self.defaults.get("fused")) or self.widened or registered

    def clip_next_step(self, factor: torch.Tensor) -> None:
        if not self.folds_clip:
            raise ValueError("clip_next_step needs optim.fused=true: torch's foreach AdamW steps the "
                             "parameters not written back and has no grad_scale hook")
        self.grad_scale = factor

    @property
    def skips_on_device(self) -> bool:
        return self.folds_clip  # the same condition: torch's fused kernel or ours steps every parameter

    def skip_next_step_if(self, found_inf: torch.Tensor) -> None:
        if not self.skips_on_device:
            raise ValueError("skip_next_step_if needs optim.fused=true: torch's foreach AdamW steps the "
                             "parameters not written back and has no found_inf hook")
        self.found_inf = found_inf

    @property
    def written_back(self) -> frozenset[int]:
        return self._written

    def register_write_back(self, param: torch.Tensor, out: torch.Tensor, zero_grad: bool = True) -> None:
        """Step `param` with the fused pass, writing `out` and, if zero_grad, zeroing its grad."""
        if out.shape != param.shape or not out.is_contiguous():
            raise ValueError(f"write-back target of shape {tuple(out.shape)} (contiguous={out.is_contiguous()}) "
                             f"does not match parameter {tuple(param.shape)}; pass a contiguous tensor of its shape")
        self._out[id(param)] = out
        self._zero[id(param)] = zero_grad

    @torch.no_grad()
    def step(self, closure=None):
        from moontrain.optim.write_back_kernel import adamw_write_back_  # imports triton

        if closure is not None:
            raise ValueError("WriteBackAdamW.step takes no closure")
        mine = [(group, p) for group in self.param_groups for p in group["params"]
                if id(p) in self._out and p.grad is not None]
        held = [p.grad for _, p in mine]
        for _, p in mine:  # torch's step skips parameters without a grad
            p.grad = None
        grad_scale = self.__dict__.pop("grad_scale", None)  # this step's clip factor (clip_next_step)
        found_inf = self.__dict__.pop("found_inf", None)  # this step's skip flag (skip_next_step_if)
        if self.defaults.get("fused") or self.widened:  # the rest's step applies them; AdamW.step drops them
            if grad_scale is not None:
                self.grad_scale = grad_scale
            if found_inf is not None:
                self.found_inf = found_inf
        try:
            super().step()
        finally:
            for (_, p), g in zip(mine, held, strict=True):
                p.grad = g
        for _, p in mine:
            self.init_state(p)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for zero in (True, False):  # one call per group and zeroing choice
                params = [p for g, p in mine if g is group and self._zero[id(p)] == zero]
                if params:
                    adamw_write_back_(
                        params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                        [self.state[p]["exp_avg_sq"] for p in params], [self.state[p]["step"] for p in params],
                        [self._out[id(p)] for p in params], lr=group["lr"], beta1=beta1, beta2=beta2,
                        eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=grad_scale,
                        found_inf=found_inf, zero_grads=zero)
        for _, p in mine:
            p.grad = None
        self._written = frozenset(id(p) for _, p in mine)
        return None
