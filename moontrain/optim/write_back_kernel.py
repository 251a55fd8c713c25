"""The Triton kernel of WriteBackAdamW (moontrain/optim/write_back.py): one launch per parameter group that
steps AdamW over every tensor of the group, writes their compute copies and zeroes their grads. Imported on
the first fused step, so moontrain imports without triton on machines that never run it.

The launch walks a table, not one tensor: the addresses of each tensor's p, g, m, v and compute copy, its
size and its first block, and for every block the tensor it belongs to (torch's multi_tensor_apply does the
same with kernel arguments). The table is built on the host once per set of tensors and kept on the device
(_TableCache: keyed by the addresses and sizes, so a moved tensor makes a new table), so a step costs a few
launches whatever the number of parameters (k3_small's dense masters are 397 tensors). The addresses must be
16-byte aligned and a tensor's whole blocks load and store unmasked: Triton knows nothing of a pointer read
from memory, and with masked accesses on such pointers (this kernel's first version) every load and store
compiles to a scalar one (sm90 PTX: 0 of 69 loads vectorised; now 4-wide, as moontrain.parallel.
grad_accumulate_kernel does it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (elements a program, warps) by the moments' dtype; benchmarks/bench_write_back.py --tiles sweeps them
# (docs/performance.md: with bf16 moments 2048 x 4 ran at 2.69 TB/s on an H100, 1024 x 4 at 2.97)
TILE = {torch.float32: (2048, 4), torch.bfloat16: (1024, 4)}
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, n, bc1, bc2_sqrt, scale_ptr, skip_ptr,
                 lr, beta1, beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr,
                 ZERO: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one tensor; MASKED for a tensor's last, partial block (the whole ones load and store
    unmasked, so with the pointers' 16-byte alignment the accesses vectorise)."""
    if MASKED:
        mask = offs < n
        p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m0 = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v0 = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        p0 = tl.load(p_ptr + offs)
        g = tl.load(g_ptr + offs)
        m0 = tl.load(m_ptr + offs).to(tl.float32)
        v0 = tl.load(v_ptr + offs).to(tl.float32)
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
    out = p.to(out_ptr.dtype.element_ty)
    m = m.to(m_ptr.dtype.element_ty)  # the moments' dtype (optim.state_dtype): rounded to nearest once a step
    v = v.to(v_ptr.dtype.element_ty)
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(out_ptr + offs, out, mask=mask)
        if ZERO:
            tl.store(g_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        tl.store(out_ptr + offs, out)
        if ZERO:
            tl.store(g_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32))


@triton.jit
def _adamw_write_back_kernel(ptrs_ptr, numel_ptr, first_ptr, owner_ptr, bc_ptr, scale_ptr, skip_ptr,
                             lr, beta1, beta2, eps, weight_decay,
                             HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, ZERO: tl.constexpr,
                             OUT_KIND: tl.constexpr, STATE_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(owner_ptr + pid)  # the tensor this block belongs to
    n = tl.load(numel_ptr + t)
    start = tl.multiple_of((pid - tl.load(first_ptr + t)).to(tl.int64) * BLOCK, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    row = ptrs_ptr + t * 5
    # every address is 16-byte aligned (adamw_write_back_ checks): vector loads and stores
    p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32)), 16)
    if STATE_BF16:
        m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.bfloat16)), 16)
        v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.bfloat16)), 16)
    else:
        m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
        v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32)), 16)
    if OUT_KIND == 1:
        out_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(tl.bfloat16)), 16)
    elif OUT_KIND == 2:
        out_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(tl.float16)), 16)
    else:
        out_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(tl.float32)), 16)
    bc1 = tl.load(bc_ptr + t * 2)  # 1 - beta1^step
    bc2_sqrt = tl.load(bc_ptr + t * 2 + 1)  # sqrt(1 - beta2^step)
    if start + BLOCK <= n:  # a whole block
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, n, bc1, bc2_sqrt, scale_ptr, skip_ptr, lr, beta1,
                     beta2, eps, weight_decay, HAS_SCALE, HAS_SKIP, ZERO, False, BLOCK)
    else:  # the tensor's last block
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, n, bc1, bc2_sqrt, scale_ptr, skip_ptr, lr, beta1,
                     beta2, eps, weight_decay, HAS_SCALE, HAS_SKIP, ZERO, True, BLOCK)


class _TableCache:
    """The device tables of the last few tensor sets launched (a set per group and zeroing choice): kept
    while their tensors stay where they are, rebuilt when any address or size changes (a checkpoint load
    that replaces the optimizer state, a new parameter set)."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, tensors: list[tuple[torch.Tensor, ...]], device: torch.device, block: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (device, block, tuple((*(t.data_ptr() for t in ts), ts[0].numel()) for ts in tensors))
        hit = self.tables.get(key)
        if hit is None:
            numels = [ts[0].numel() for ts in tensors]
            blocks = [triton.cdiv(n, block) for n in numels]
            first = torch.tensor([0, *blocks[:-1]], dtype=torch.int64).cumsum(0)
            owner = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32), torch.tensor(blocks))
            ptrs = torch.tensor([[t.data_ptr() for t in ts] for ts in tensors], dtype=torch.int64)
            host = (ptrs, torch.tensor(numels, dtype=torch.int64), first, owner)
            if device.type == "cuda":  # pinned and queued: building a table never waits for the device
                host = tuple(x.pin_memory().to(device, non_blocking=True) for x in host)
            hit = host
            if len(self.tables) >= self.keep:
                self.tables.pop(next(iter(self.tables)))
            self.tables[key] = hit
        return hit


_TABLES = _TableCache()


def adamw_write_back_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], outs: list[torch.Tensor], *,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                      zero_grads: bool = True) -> None:
    """One AdamW step over each (p, g, m, v, step) in place (m and v fp32 or bf16: computed in fp32, stored rounded
    to nearest), out <- p in out's dtype, g <- 0 (unless
    zero_grads is False: a backend that overwrites its grads on the next accumulation), in one launch per
    compute dtype of the outs. `steps` are the per-parameter float32 step tensors, incremented here first
    (as torch does). found_inf: a float32 device scalar; where it is 1, p, m, v and the steps keep their
    values (torch's fused AdamW's AMP hook: a skipped step), out and g are written as usual."""
    for name, ts in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("outs", outs)):
        for p, t in zip(params, ts, strict=True):
            if t.shape != p.shape or not t.is_contiguous() or t.device != p.device:
                raise ValueError(f"adamw_write_back_: {name} entry of shape {tuple(t.shape)} on {t.device} "
                                 f"(contiguous={t.is_contiguous()}) does not match its parameter "
                                 f"{tuple(p.shape)} on {p.device}; pass contiguous tensors of the parameter's shape")
    state_dtype = exp_avgs[0].dtype if exp_avgs else torch.float32
    for p, g, m, v, out in zip(params, grads, exp_avgs, exp_avg_sqs, outs, strict=True):
        if not (p.dtype == g.dtype == torch.float32) or not p.is_contiguous():
            raise ValueError(f"adamw_write_back_ needs contiguous float32 parameters and grads, got "
                             f"{p.dtype}/{g.dtype}")
        if not (m.dtype == v.dtype == state_dtype) or state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"adamw_write_back_: moments of dtype {m.dtype}/{v.dtype}; one call takes float32 or "
                             f"bfloat16 moments (optim.state_dtype), all of one dtype")
        if out.dtype not in _OUT_KINDS:
            raise ValueError(f"adamw_write_back_: compute copy of dtype {out.dtype}; the kernel writes "
                             f"{', '.join(str(d) for d in _OUT_KINDS)}")
    if not params:
        return
    misaligned = [i for i, ts in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, outs, strict=True))
                  if any(t.data_ptr() % 16 for t in ts)]
    if misaligned:
        raise ValueError(f"adamw_write_back_: entries {misaligned[:8]} start off a 16-byte boundary (the kernel's "
                         "vector loads need it); pass whole tensors or views at a 16-byte offset")
    device = params[0].device
    if any(p.device != device for p in params):
        raise ValueError(f"adamw_write_back_: parameters on {sorted({str(p.device) for p in params})}; one launch "
                         "steps the parameters of one device")
    torch._foreach_add_(steps, 1.0)
    step_P = torch.stack(steps)
    bc_P2 = torch.stack([1.0 - torch.pow(beta1, step_P), torch.sqrt(1.0 - torch.pow(beta2, step_P))], dim=1)
    scale = grad_scale if grad_scale is not None else bc_P2  # never read when HAS_SCALE is off
    skip = found_inf if found_inf is not None else bc_P2  # never read when HAS_SKIP is off
    block, warps = TILE[state_dtype]
    for dtype, kind in _OUT_KINDS.items():
        idx = [i for i, out in enumerate(outs) if out.dtype == dtype]
        if not idx:
            continue
        ptrs, numel, first, owner = _TABLES.get(
            [(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], outs[i]) for i in idx], device, block)
        bc = bc_P2 if len(idx) == len(params) else bc_P2[idx]
        _adamw_write_back_kernel[(owner.numel(),)](
            ptrs, numel, first, owner, bc, scale, skip, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), HAS_SCALE=grad_scale is not None, HAS_SKIP=found_inf is not None, ZERO=zero_grads,
            OUT_KIND=kind, STATE_BF16=state_dtype == torch.bfloat16, BLOCK=block, num_warps=warps)
    if found_inf is not None:  # a skipped step does not count (torch's fused AdamW takes it back the same way)
        torch._foreach_sub_(steps, [found_inf] * len(steps))
