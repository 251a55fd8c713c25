"""Inputs and the derived check for moontrain.model.kda.short_conv_kernel (the interpreted and the GPU tests).

Tolerance, derived: the exact values are the specification (kda.short_conv) evaluated in float64 on the
same inputs, its gradients by float64 autograd. The specification run in the inputs' own precision is the
path the kernel replaces; its error against the exact values measures what that precision costs. The kernel
accumulates in fp32 and rounds once into the output dtype, so its max error must be at most twice the
specification's plus one ulp of the output dtype at the largest exact value (a round to nearest costs half
an ulp; Triton's interpreter truncates a cast, a whole ulp).
"""

from __future__ import annotations

import functools

import torch

from moontrain.model.kda.short_conv import short_conv
from moontrain.model.kda.short_conv_kernel import short_conv_silu


def doc_ids(B: int, T: int, starts: list[list[int]], device: str, gen: torch.Generator | None = None,
            p_start: float = 0.0) -> torch.Tensor:
    """int64 [B, T] document ids: a document starts at t = 0, at each of `starts[b]`, and (with `gen`) at
    random tokens with probability p_start."""
    start_BT = torch.zeros(B, T, dtype=torch.bool, device=device)
    if gen is not None:
        start_BT |= torch.rand(B, T, generator=gen, device=device) < p_start
    for b, row in enumerate(starts):
        start_BT[b, row] = True
    return start_BT.long().cumsum(1) + 7  # ids need not start at 0


def conv_inputs(B: int, T: int, C: int, W: int, x_dtype: torch.dtype, w_dtype: torch.dtype, device: str,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, w, dy): x and dy column slices of wider row-major tensors (as q = qkv[..., :C]), w [C, 1, W]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x_wide = torch.randn(B, T, C + 24, generator=gen, device=device).to(x_dtype)
    dy_wide = torch.randn(B, T, 2 * C, generator=gen, device=device).to(x_dtype)
    w = (torch.rand(C, 1, W, generator=gen, device=device) * 2 - 1).div(W ** 0.5).to(w_dtype)
    return x_wide[..., 8:8 + C], w, dy_wide[..., C:]


def _value_and_grads(x: torch.Tensor, w: torch.Tensor, doc_id: torch.Tensor | None, dy: torch.Tensor,
                     fn) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w, doc_id)
    return (y.detach(), *torch.autograd.grad(y, (x, w), dy))


def check_short_conv(x: torch.Tensor, w: torch.Tensor, doc_id: torch.Tensor | None, dy: torch.Tensor,
                     backward: str = "tiles") -> None:
    """short_conv_silu's y, dx and dw (its backward kernels: `backward`) against the exact values, within the
    bound of the module docstring."""
    got = _value_and_grads(x, w, doc_id, dy, functools.partial(short_conv_silu, backward=backward))
    spec = _value_and_grads(x, w, doc_id, dy, short_conv)
    exact = _value_and_grads(x.double(), w.double(), doc_id, dy.double(), short_conv)
    for name, g, s, e in zip(("y", "dx", "dw"), got, spec, exact, strict=True):
        want_dtype = w.dtype if name == "dw" else x.dtype
        assert g.dtype == want_dtype and g.shape == e.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        err, err_spec = (g.double() - e).abs().max().item(), (s.double() - e).abs().max().item()
        bound = 2 * err_spec + torch.finfo(want_dtype).eps * e.abs().max().item()
        assert err <= bound, (f"{name}: max error {err:.3g} > bound {bound:.3g} (spec in {want_dtype}: {err_spec:.3g},"
                              f" largest value {e.abs().max().item():.3g})")
