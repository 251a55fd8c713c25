"""Dense gated feed-forward (the first layer(s) and the shared experts): w_down(act(w_gate x, w_up x)).

The activation is SwiGLU's silu(g) * u or K3's SiTU-GLU (moonep.activation: the routed experts' op
uses the same specification, so every FFN of a model computes one function).

One autograd op (`_GatedFFN`, GatedFFN's forward), like the routed experts' (moonep.expert_glu): it
saves x, h = w_gate x and u = w_up x, and recomputes a = act(h, u) in backward for w_down's weight gradient. Built from
nn.Linear and the activation, autograd (and torch.compile's partitioner) also kept a for w_down:
[tokens, hidden] per FFN (DeepSeek-V3 widths at 32k tokens per pass: 128 MiB per shared-expert FFN,
352 MiB for the dense layer). The forward is the modules' math op for op (the logits of
transformers' DeepseekV3 are matched against it); backward is the activation's one-pass gradient
(moonep.glu_backward: the specification, or on bf16 CUDA tensors the routed experts' backward kernel
with unit row weights), the weight and input gradients as nn.Linear's.
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
        from moonep import glu_backward  # moonep is imported only where it is used

        grad_h, grad_u, a = glu_backward(ctx.activation, grad_y @ w_down, h, u)
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
