"""Dense gated feed-forward (the first layer(s) and the shared experts): w_down(act(w_gate x, w_up x)).

The activation is SwiGLU's silu(g) * u or K3's SiTU-GLU (moonep.situ_glu: the routed experts' op
uses the same specification, so every FFN of a model computes one function).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moontrain.model.config import FFNActivation


def glu_activation(name: FFNActivation, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """act(g, u) of the gate and up projections' outputs (ModelConfig.ffn_activation)."""
    if name == "situ_glu":
        from moonep import situ_glu  # moonep is imported only where it is used

        return situ_glu(g, u)
    return F.silu(g) * u


class GatedFFN(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: FFNActivation = "swiglu",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.activation = activation
        self.w_gate = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_up = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_down = nn.Linear(hidden, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(glu_activation(self.activation, self.w_gate(x), self.w_up(x)))
