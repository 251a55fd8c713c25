"""The gated activations of the expert op (docs/moonep.md §6.6) in PyTorch: a parameter of
`moonep.expert_glu`, by name; the specification each Triton kernel of moonep.kernels (swiglu.py,
situ_glu.py) is tested against, and the form every device can run.

Each entry is a = f(h, u) of the gate projection h = x W_gate and the up projection u = x W_up:
`forward(h, u) -> a` and the elementwise backward `backward(grad_a, h, u) -> (grad_h, grad_u, a)` (a
recomputed for the down projection's weight gradient). The triton data path fuses each into one kernel
per direction (moonep.datapath.triton_path.GLU_KERNELS holds one pair per name here).

    swiglu     a = silu(h) * u   (silu rounded to h's dtype first, as F.silu(h) * u does)
    situ_glu   a = situ(h) * cap(u)   situ(h) = 4 tanh(h / 4) sigmoid(h)   cap(u) = 25 tanh(u / 25)
               (Kimi K3: SwiGLU with both factors soft-capped, |situ(h)| < 4 and |cap(u)| < 25)

SiTU-GLU's derivatives:

    situ'(h) = (1 - t^2) sig + 4 t sig (1 - sig)    t = tanh(h / 4), sig = sigmoid(h)
    cap'(u)  = 1 - c^2                              c = tanh(u / 25)
    grad_h = grad_a * cap(u) * situ'(h)             grad_u = grad_a * situ(h) * cap'(u)

Its numerics: everything in fp32 from the inputs' values, each result rounded once to the inputs' dtype.
The transcendentals are written out in terms of exp of a non-positive argument (sigmoid and
sig (1 - sig) from exp(-|x|); tanh and 1 - tanh^2 from exp(-2|x|), with a Taylor polynomial for
|x| < 1/16 where 1 - exp(-2|x|) would cancel), so the derivatives keep their relative accuracy in the
saturated tails; one operation at a time, in the order the Triton kernels evaluate them. The kernels
differ from this only by their exp (Triton's interpreter uses numpy's, the GPU its own) and, on the
GPU, by fp32 division. `situ_glu` is the differentiable op (moontrain's dense FFNs and shared experts
call it); it runs the kernels on bf16 CUDA tensors.

Rejected: torch.tanh / torch.sigmoid for SiTU-GLU here and libdevice's tanh in the kernel (Triton's
interpreter has no libdevice, so the kernel could not be checked on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def swiglu_forward(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(h) * u


def swiglu_backward(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) for a = silu(h) * u, in fp32 with one rounding to h's dtype: autograd's own
    formulas (ATen's silu_backward of grad_a * u; grad_a * silu(h)), so that in fp32 the dense FFN op
    (moontrain.model.ffn) gives autograd's bits."""
    hf, uf, ga = h.float(), u.float(), grad_a.float()
    grad_h = torch.ops.aten.silu_backward(ga * uf, hf).to(h.dtype)
    grad_u = (ga * F.silu(hf)).to(h.dtype)
    return grad_h, grad_u, swiglu_forward(h, u)


GATE_CAP = 4.0  # situ(h) = GATE_CAP * tanh(h / GATE_CAP) * sigmoid(h)
UP_CAP = 25.0  # cap(u) = UP_CAP * tanh(u / UP_CAP)
TAYLOR_BELOW = 0.0625  # |x| under which tanh(x) is its Taylor polynomial x - x^3/3 + 2x^5/15


def _tanh_sech2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tanh(x), 1 - tanh(x)^2) of fp32 x in the kernel's operation order. 1 - tanh^2 is taken as
    4e / (1 + e)^2 (e = exp(-2|x|)) outside the Taylor range: relative accuracy where tanh -> +-1."""
    x2 = x * x
    poly = x + x * (x2 * (x2 * (2.0 / 15.0) - (1.0 / 3.0)))
    e = torch.exp(-2.0 * x.abs())
    big = (1.0 - e) / (1.0 + e)
    small = x.abs() < TAYLOR_BELOW
    t = torch.where(small, poly, torch.where(x < 0, -big, big))
    sech2 = torch.where(small, 1.0 - poly * poly, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    return t, sech2


def _sigmoid_dsigmoid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmoid(x), sigmoid(x) (1 - sigmoid(x))) of fp32 x from e = exp(-|x|) (never overflows)."""
    e = torch.exp(-x.abs())
    inv = 1.0 / (1.0 + e)
    return torch.where(x < 0, e * inv, inv), e * (inv * inv)


def situ_glu_forward(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """a = situ(h) * cap(u), computed in fp32 and rounded once to h's dtype (no autograd)."""
    hf, uf = h.float(), u.float()
    t, _ = _tanh_sech2(hf / GATE_CAP)
    sig, _ = _sigmoid_dsigmoid(hf)
    c, _ = _tanh_sech2(uf / UP_CAP)
    return ((GATE_CAP * t * sig) * (UP_CAP * c)).to(h.dtype)


def situ_glu_backward(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) from grad_a in one pass, each rounded once to h's dtype; `a` is the forward's
    value (recomputed for the down projection's weight gradient)."""
    hf, uf, ga = h.float(), u.float(), grad_a.float()
    t, sech2_t = _tanh_sech2(hf / GATE_CAP)
    sig, dsig = _sigmoid_dsigmoid(hf)
    c, sech2_c = _tanh_sech2(uf / UP_CAP)
    situ = GATE_CAP * t * sig
    cap = UP_CAP * c
    dsitu = sech2_t * sig + GATE_CAP * t * dsig
    grad_h = ga * cap * dsitu
    grad_u = ga * situ * sech2_c
    return grad_h.to(h.dtype), grad_u.to(h.dtype), (situ * cap).to(h.dtype)


def _uses_kernels(h: torch.Tensor) -> bool:
    """The Triton kernels for bf16 CUDA tensors (what they are written for), this module elsewhere."""
    return h.is_cuda and h.dtype == torch.bfloat16


class _SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, u)
        if _uses_kernels(h):
            from moonep.kernels.situ_glu import situ_glu_forward as kernel_forward

            return kernel_forward(h.contiguous(), u.contiguous())
        return situ_glu_forward(h, u)

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, u = ctx.saved_tensors
        if _uses_kernels(h):
            from moonep.kernels.situ_glu import situ_glu_backward as kernel_backward

            grad_h, grad_u, _ = kernel_backward(grad_a, h.contiguous(), u.contiguous())
        else:
            grad_h, grad_u, _ = situ_glu_backward(grad_a, h, u)
        return grad_h, grad_u


def situ_glu(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Differentiable SiTU-GLU: situ_glu_forward, with situ_glu_backward's one-pass gradients (saves
    only h and u, like SwiGLU); on bf16 CUDA tensors both run as moonep.kernels.situ_glu's kernels."""
    if h.shape != u.shape or h.dtype != u.dtype:
        raise ValueError(f"situ_glu needs h and u of one shape and dtype, got {tuple(h.shape)} {h.dtype} and "
                         f"{tuple(u.shape)} {u.dtype}")
    return _SiTUGLU.apply(h, u)


def glu_backward(activation: str, grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) of a = f(h, u) for the registered `activation`, each one fp32 value rounded once,
    for tensors of any leading shape: on bf16 CUDA tensors moonep.kernels.glu_route's one-pass kernel with
    unit row weights, elsewhere the specification (the dense FFNs' backward, which recomputes a)."""
    if not _uses_kernels(h):
        return get_activation(activation).backward(grad_a, h, u)
    from moonep.kernels.glu_route import glu_route_backward

    rows = lambda t: t.contiguous().view(-1, t.shape[-1])
    ones = torch.ones(rows(h).shape[0], dtype=torch.float32, device=h.device)  # route weight 1: a_w = a
    grads = glu_route_backward(activation, rows(grad_a), rows(h), rows(u), ones)
    return tuple(t.view(h.shape) for t in grads[:3])


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
