"""Fused AdamW step for the expert masters that also writes their compute copy and zeroes their grad.

Per expert projection the step protocol after backward is AdamW (read p, g, m, v; write p, m, v), then
push_master (read p, write the bf16 compute rows) and zero_grads (write g): 34 bytes per parameter in
three passes, plus torch's fused kernel writing the clip-scaled grad back (4 more). One Triton pass
does it all: reads p, g, m, v, writes p, m, v, the compute copy and g = 0 (34 bytes; 30 for moonep,
whose next accumulation overwrites the grads: moonep.ExpertPools.defer_zero_grads). On 2xH200 at
k3_small_moe (4.25B expert parameters per rank, 2026-11-29) the three passes took ~42 + 8 + 6 ms.

The math is torch's fused AdamW (ATen's fused_adam_utils, ADAMW mode), in fp32:
    g = g / grad_scale                       (when the optimizer carries a clip factor, see clip.py)
    p = p - lr * wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
with the bias corrections computed on the device from the step tensors (no host read). Values match
torch's AdamW up to fp32 contraction (a few ulps per step; tests/moontrain/optim/test_write_back_*).
State is torch's (exp_avg, exp_avg_sq, a float32 step tensor on the parameter's device), so
checkpoints and the optimizer's state_dict do not change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _adamw_write_back_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, bc_ptr, scale_ptr, n,
                             lr, beta1, beta2, eps, weight_decay,
                             HAS_SCALE: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bc1 = tl.load(bc_ptr)  # 1 - beta1^step
    bc2_sqrt = tl.load(bc_ptr + 1)  # sqrt(1 - beta2^step)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - (lr / bc1) * m / denom
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)
    if ZERO:
        tl.store(g_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


def adamw_write_back_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], outs: list[torch.Tensor], *,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      grad_scale: torch.Tensor | None = None, zero_grads: bool = True) -> None:
    """One AdamW step over each (p, g, m, v, step) in place, out <- p in out's dtype, g <- 0 (unless
    zero_grads is False: a backend that overwrites its grads on the next accumulation).
    `steps` are the per-parameter float32 step tensors, incremented here first (as torch does)."""
    for name, ts in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("outs", outs)):
        for p, t in zip(params, ts, strict=True):
            if t.shape != p.shape or not t.is_contiguous() or t.device != p.device:
                raise ValueError(f"adamw_write_back_: {name} entry of shape {tuple(t.shape)} on {t.device} "
                                 f"(contiguous={t.is_contiguous()}) does not match its parameter "
                                 f"{tuple(p.shape)} on {p.device}; pass contiguous tensors of the parameter's shape")
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if not (p.dtype == g.dtype == m.dtype == v.dtype == torch.float32) or not p.is_contiguous():
            raise ValueError(f"adamw_write_back_ needs contiguous float32 parameters, grads and moments, got "
                             f"{p.dtype}/{g.dtype}/{m.dtype}/{v.dtype}")
    if not params:
        return
    torch._foreach_add_(steps, 1.0)
    step_P = torch.stack(steps)
    bc_P2 = torch.stack([1.0 - torch.pow(beta1, step_P), torch.sqrt(1.0 - torch.pow(beta2, step_P))], dim=1)
    scale = grad_scale if grad_scale is not None else bc_P2  # never read when HAS_SCALE is off
    for i, (p, g, m, v, out) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, outs, strict=True)):
        n = p.numel()
        _adamw_write_back_kernel[(triton.cdiv(n, _BLOCK),)](
            p, g, m, v, out, bc_P2[i], scale, n, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), HAS_SCALE=grad_scale is not None, ZERO=zero_grads, BLOCK=_BLOCK, num_warps=4)


class WriteBackAdamW(torch.optim.AdamW):
    """torch's AdamW, except for parameters registered with `register_write_back`: their step is
    `adamw_write_back_` (which also writes the registered compute tensor and zeroes the grad unless
    registered with zero_grad=False, then drops p.grad). `last_written` holds the ids of the
    parameters the last step wrote back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if self.defaults.get(flag):
                raise ValueError(f"WriteBackAdamW implements plain AdamW; {flag}=True is not supported")
        self._out: dict[int, torch.Tensor] = {}
        self._zero: dict[int, bool] = {}
        self.last_written: set[int] = set()

    def register_write_back(self, param: torch.Tensor, out: torch.Tensor, zero_grad: bool = True) -> None:
        """Step `param` with the fused pass, writing `out` and, if zero_grad, zeroing its grad."""
        if out.shape != param.shape or not out.is_contiguous():
            raise ValueError(f"write-back target of shape {tuple(out.shape)} (contiguous={out.is_contiguous()}) "
                             f"does not match parameter {tuple(param.shape)}; pass a contiguous tensor of its shape")
        self._out[id(param)] = out
        self._zero[id(param)] = zero_grad

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("WriteBackAdamW.step takes no closure")
        mine = [(group, p) for group in self.param_groups for p in group["params"]
                if id(p) in self._out and p.grad is not None]
        held = [p.grad for _, p in mine]
        for _, p in mine:  # torch's step skips parameters without a grad
            p.grad = None
        try:
            super().step()
        finally:
            for (_, p), g in zip(mine, held, strict=True):
                p.grad = g
        grad_scale = getattr(self, "grad_scale", None)
        for _, p in mine:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:  # e.g. a step count restored on the CPU
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
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
                        zero_grads=zero)
        for _, p in mine:
            p.grad = None
        self.last_written = {id(p) for _, p in mine}
        return None
