"""torch's AdamW under the training step's optimizer contract (moontrain/optim/protocol.py), and AdamW with
bf16 moments (optim.state_dtype=bfloat16), which torch's AdamW does not take for fp32 parameters.

A fused one folds the global-norm clip into its step: `clip_next_step` sets torch's `grad_scale` (the AMP
hook of the fused Adam kernels, which divides each grad by it inside the kernel) and step() removes it
again, so the factor applies to that step only. Likewise `skip_next_step_if` sets torch's `found_inf` (the
kernel leaves parameters and moments as they were where it is 1, and the step counts are taken back), so a
non-finite step is skipped on the device. Nothing is written back: `written_back` is empty.

bf16 moments (DeepSeek-V3 trains with them, its report's section 3.3.2): exp_avg and exp_avg_sq are stored in
bf16, the step computes in fp32 from their widened values and rounds them to nearest once a step; the masters
stay fp32. Half the moments' memory (4 bytes a parameter fewer) and, in the write-back pass
(moontrain.optim.write_back_kernel, which is the same math), 22 bytes of traffic a parameter instead of 30.
With beta2 = 0.95 a step moves v by 5 % of (g^2 - v), well above bf16's 2^-8 resolution; at beta2 = 0.999 most
steps would round back to the old v. The step here (_widened_step) runs the parameters it steps (FSDP's shards,
the CPU's) through that kernel on a GPU (one launch a group) and through torch ops elsewhere: the kernel's
formula, with the clip factor and the skip flag applied as torch's fused kernel applies them, which is the
specification the kernel is tested against.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class AdamW(torch.optim.AdamW):
    def __init__(self, *args, state_dtype: torch.dtype = torch.float32, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if state_dtype not in STATE_DTYPES.values():
            raise ValueError(f"AdamW state_dtype {state_dtype}: moments are float32 or bfloat16 (optim.state_dtype)")
        self.state_dtype = state_dtype
        if state_dtype != torch.float32:
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if self.defaults.get(flag):
                    raise ValueError(f"AdamW with {state_dtype} moments implements plain AdamW; {flag}=True is not "
                                     "supported")

    @property
    def widened(self) -> bool:
        """The moments are stored narrower than the fp32 math (the step is _widened_step, not torch's)."""
        return self.state_dtype != torch.float32

    @property
    def folds_clip(self) -> bool:
        return bool(self.defaults.get("fused")) or self.widened

    def clip_next_step(self, factor: torch.Tensor) -> None:
        if not self.folds_clip:
            raise ValueError("clip_next_step needs a fused optimizer (optim.fused=true): torch's foreach AdamW "
                             "has no grad_scale hook; scale the grads instead")
        self.grad_scale = factor

    @property
    def skips_on_device(self) -> bool:
        return bool(self.defaults.get("fused")) or self.widened

    def skip_next_step_if(self, found_inf: torch.Tensor) -> None:
        if not self.skips_on_device:
            raise ValueError("skip_next_step_if needs a fused optimizer (optim.fused=true): torch's foreach AdamW "
                             "has no found_inf hook; read the verdict on the host instead")
        self.found_inf = found_inf

    @property
    def written_back(self) -> frozenset[int]:
        return frozenset()

    def moment_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of p's moments: state_dtype when it is narrower than fp32 (optim.state_dtype), else p's (torch's
        own AdamW keeps its parameters' dtype)."""
        return self.state_dtype if self.widened else p.dtype

    def init_state(self, p: torch.Tensor) -> dict:
        """p's state as the first step makes it (a float32 step count on p's device, zero moments)."""
        state = self.state[p]
        if not state:
            dtype = self.moment_dtype(p)
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # e.g. a step count restored on the CPU
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        return state

    def step(self, closure=None):
        try:
            if not self.widened:
                return super().step(closure)
            if closure is not None:
                raise ValueError("AdamW with bf16 moments takes no closure")
            self._widened_step()
            return None
        finally:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)

    @torch.no_grad()
    def _widened_step(self) -> None:
        scale = self.__dict__.get("grad_scale")
        found_inf = self.__dict__.get("found_inf")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            params = [p for p in group["params"] if p.grad is not None]
            fast = [p for p in params if _kernel_steps(p, self.init_state(p))]
            if fast:
                from moontrain.optim.write_back_kernel import adamw_write_back_  # imports triton

                ts = [[_local(t) for t in (p, p.grad, self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"])]
                      for p in fast]
                ps, gs, ms, vs = (list(x) for x in zip(*ts, strict=True))
                # the write-back pass with each parameter as its own "compute copy" (the same value stored twice)
                adamw_write_back_(ps, gs, ms, vs, [self.state[p]["step"] for p in fast], ps, lr=lr, beta1=beta1,
                                  beta2=beta2, eps=eps, weight_decay=wd, grad_scale=scale, found_inf=found_inf,
                                  zero_grads=False)
            kernel = {id(p) for p in fast}
            for param in (p for p in params if id(p) not in kernel):
                state = self.init_state(param)
                step = state["step"]
                step += 1
                # elementwise: an FSDP shard (DTensor) steps its local rows
                p, grad, m_t, v_t = (_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"]))
                g = grad.float() if scale is None else grad.float() / scale
                m0, v0 = m_t.float(), v_t.float()
                p0 = p.detach().clone() if found_inf is not None else None
                new = p.detach() - lr * wd * p.detach()
                m = beta1 * m0 + (1.0 - beta1) * g
                v = beta2 * v0 + (1.0 - beta2) * g * g
                denom = v.sqrt() / torch.sqrt(1.0 - torch.pow(beta2, step)) + eps
                new = new - (lr / (1.0 - torch.pow(beta1, step))) * m / denom
                if found_inf is not None:  # a skipped step keeps the old values and does not count
                    keep = found_inf != 0
                    new, m, v = torch.where(keep, p0, new), torch.where(keep, m0, m), torch.where(keep, v0, v)
                    step -= found_inf
                p.detach().copy_(new)
                m_t.copy_(m)
                v_t.copy_(v)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _kernel_steps(p: torch.Tensor, state: dict) -> bool:
    """Whether moontrain.optim.write_back_kernel steps p (with the group's others, one launch): on CUDA, a
    contiguous fp32 master and grad and bf16 moments at 16-byte-aligned addresses; else the torch ops (an FSDP
    grad can start mid-line where a small parameter's shard ends before it in the reduce-scatter buffer)."""
    tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
    return (all(t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)
            and tensors[0].dtype == tensors[1].dtype == torch.float32
            and tensors[2].dtype == tensors[3].dtype == torch.bfloat16)
