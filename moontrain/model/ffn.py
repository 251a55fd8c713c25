"""Dense gated feed-forward (the first layer(s) and the shared experts): w_down(act(w_gate x, w_up x)).

The activation is SwiGLU's silu(g) * u or K3's SiTU-GLU (moonep.activation: the routed experts' op
uses the same specification, so every FFN of a model computes one function).

One autograd op (`gated_ffn`), like the routed experts' (moonep.expert_glu): it saves x, h = w_gate x
and u = w_up x, and recomputes a = act(h, u) in backward for w_down's weight gradient. Built from
nn.Linear and the activation, autograd (and torch.compile's partitioner) also kept a for w_down:
[tokens, hidden] per FFN (DeepSeek-V3 widths at 32k tokens per pass: 128 MiB per shared-expert FFN,
352 MiB for the dense layer). The forward is the modules' math op for op (the logits of
transformers' DeepseekV3 are matched against it); backward is the activation's one-pass gradient
(moonep.activation's specification; on bf16 CUDA tensors moonep.kernels.glu_route's kernel with unit
row weights), the weight and input gradients as nn.Linear's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moontrain.model.config import FFNActivation


def glu_activation(name: FFNActivation, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """act(g, u) of the gate and up projections' outputs (ModelConfig.ffn_activation), differentiable."""
    if name == "situ_glu":
        from moonep import situ_glu  # moonep is imported only where it is used

        return situ_glu(g, u)
    return F.silu(g) * u


def _activation_grads(name: FFNActivation, grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) of a = act(h, u), each one fp32 value rounded once."""
    if h.is_cuda and h.dtype == torch.bfloat16:
        from moonep.kernels.glu_route import glu_route_backward

        rows = lambda t: t.reshape(-1, t.shape[-1])
        ones = torch.ones(rows(h).shape[0], dtype=torch.float32, device=h.device)  # route weight 1: a_w = a
        grads = glu_route_backward(name, rows(grad_a.contiguous()), rows(h.contiguous()), rows(u.contiguous()), ones)
        return tuple(t.view(h.shape) for t in grads[:3])
    from moonep.activation import get_activation

    return get_activation(name).backward(grad_a, h, u)


class _GatedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                activation: FFNActivation) -> torch.Tensor:
        h, u = F.linear(x, w_gate), F.linear(x, w_up)
        with torch.no_grad():
            a = glu_activation(activation, h, u)
        ctx.save_for_backward(x, w_gate, w_up, w_down, h, u)
        ctx.activation = activation
        return F.linear(a, w_down)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, w_gate, w_up, w_down, h, u = ctx.saved_tensors
        grad_h, grad_u, a = _activation_grads(ctx.activation, grad_y @ w_down, h, u)
        grad_x = grad_h @ w_gate + grad_u @ w_up
        flat = lambda t: t.reshape(-1, t.shape[-1])
        grad_w_down = flat(grad_y).t() @ flat(a)
        grad_w_gate = flat(grad_h).t() @ flat(x)
        grad_w_up = flat(grad_u).t() @ flat(x)
        return grad_x, grad_w_gate, grad_w_up, grad_w_down, None


class GatedFFN(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: FFNActivation = "swiglu",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.activation = activation
        self.w_gate = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_up = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_down = nn.Linear(hidden, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatedFFN.apply(x, self.w_gate.weight, self.w_up.weight, self.w_down.weight, self.activation)
