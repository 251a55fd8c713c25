"""The expert op's activation (docs/moonep.md §6.6): a parameter of `moonep.expert_glu`, by name.

Each entry is a gated activation a = f(h, u) of the gate projection h = x W_gate and the up
projection u = x W_up, given here in PyTorch as the specification: `forward(h, u) -> a` and the
elementwise backward `backward(grad_a, h, u) -> (grad_h, grad_u, a)` (a recomputed for the down
projection's weight gradient). The triton data path fuses each into one kernel per direction
(moonep.datapath.triton_path.GLU_KERNELS holds one pair per name here).

    swiglu     a = silu(h) * u   (silu rounded to h's dtype first, as F.silu(h) * u does)
    situ_glu   a = 4 tanh(h/4) sigmoid(h) * 25 tanh(u/25)   (Kimi K3; moonep.situ_glu, fp32, one rounding)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moonep.situ_glu import situ_glu_backward, situ_glu_forward


def swiglu_forward(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(h) * u


def swiglu_backward(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) for a = silu(h) * u, in fp32 with one rounding to h's dtype."""
    hf = h.float()
    sig = torch.sigmoid(hf)
    ga = grad_a.float()
    grad_h = (ga * u.float() * sig * (1 + hf * (1 - sig))).to(h.dtype)
    grad_u = (ga * (hf * sig)).to(h.dtype)
    return grad_h, grad_u, swiglu_forward(h, u)


@dataclass(frozen=True, slots=True)
class GatedActivation:
    name: str
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


ACTIVATIONS: dict[str, GatedActivation] = {
    "swiglu": GatedActivation("swiglu", swiglu_forward, swiglu_backward),
    "situ_glu": GatedActivation("situ_glu", situ_glu_forward, situ_glu_backward),
}


def get_activation(name: str) -> GatedActivation:
    """The registered activation `name`, or a ValueError naming the choices."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {name!r}; moonep has {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
