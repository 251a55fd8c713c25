"""The Triton kernel of WriteBackAdamW (moontrain/optim/write_back.py): one pass per expert projection
that steps AdamW, writes the compute copy and zeroes the grad. Imported on the first fused step, so
moontrain imports without triton on machines that never run it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _adamw_write_back_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, bc_ptr, scale_ptr, skip_ptr, n,
                             lr, beta1, beta2, eps, weight_decay,
                             HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, ZERO: tl.constexpr,
                             BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bc1 = tl.load(bc_ptr)  # 1 - beta1^step
    bc2_sqrt = tl.load(bc_ptr + 1)  # sqrt(1 - beta2^step)
    p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m0 = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v0 = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p0 - lr * weight_decay * p0
    m = beta1 * m0 + (1.0 - beta1) * g
    v = beta2 * v0 + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - (lr / bc1) * m / denom
    if HAS_SKIP:  # a skipped step (found_inf = 1) keeps the old values
        keep = tl.load(skip_ptr) != 0.0
        p = tl.where(keep, p0, p)
        m = tl.where(keep, m0, m)
        v = tl.where(keep, v0, v)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)
    if ZERO:
        tl.store(g_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


def adamw_write_back_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], outs: list[torch.Tensor], *,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                      zero_grads: bool = True) -> None:
    """One AdamW step over each (p, g, m, v, step) in place, out <- p in out's dtype, g <- 0 (unless
    zero_grads is False: a backend that overwrites its grads on the next accumulation).
    `steps` are the per-parameter float32 step tensors, incremented here first (as torch does).
    found_inf: a float32 device scalar; where it is 1, p, m, v and the steps keep their values (torch's
    fused AdamW's AMP hook: a skipped step), out and g are written as usual."""
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
    skip = found_inf if found_inf is not None else bc_P2  # never read when HAS_SKIP is off
    for i, (p, g, m, v, out) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, outs, strict=True)):
        n = p.numel()
        _adamw_write_back_kernel[(triton.cdiv(n, _BLOCK),)](
            p, g, m, v, out, bc_P2[i], scale, skip, n, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), HAS_SCALE=grad_scale is not None, HAS_SKIP=found_inf is not None, ZERO=zero_grads,
            BLOCK=_BLOCK, num_warps=4)
    if found_inf is not None:  # a skipped step does not count (torch's fused AdamW takes it back the same way)
        torch._foreach_sub_(steps, [found_inf] * len(steps))
