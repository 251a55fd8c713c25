"""KDA's causal depthwise short convolutions + SiLU (on q, k and v), in pure PyTorch: the specification
moontrain.model.kda.short_conv_kernel's Triton kernels are tested against, and the choice between the two
(kernels.short_conv).

Legend: B batch, T sequence, C channels, W conv taps (model.kda_conv_size).

    y[t] = silu(sum_{s<W} w[c, 0, W-1-s] x[t-s])   over taps with t-s >= 0 inside x_t's document

The weight is nn.Conv1d's depthwise [C, 1, W] in its tap order (Kimi Linear's q_conv1d / k_conv1d / v_conv1d),
so the Hugging Face export maps it as it is. A tap across a document start counts zero: no token sees an
earlier document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moontrain.model.kernel_choice import runs_triton


def select_short_conv(choice: str, device: torch.device | str | None,
                      backward: str = "tiles") -> Callable[..., torch.Tensor]:
    """The short convolution of kernels.short_conv = `choice` (auto, torch or triton) on `device`; the Triton one
    with kernels.short_conv_backward = `backward` (tiles or walk)."""
    if not runs_triton("short_conv", choice, device, "the PyTorch convolution"):
        return short_conv
    from moontrain.model.kda.short_conv_kernel import short_conv_silu  # imports triton: only where it runs

    return short_conv_silu if backward == "tiles" else functools.partial(short_conv_silu, backward=backward)


def short_conv(x_BTC: torch.Tensor, w_C1W: torch.Tensor, doc_id_BT: torch.Tensor | None) -> torch.Tensor:
    """silu(sum_s w[:, 0, W-1-s] * x_{t-s}) over taps s = 0..W-1 (nn.Conv1d's weight with causal padding),
    a tap counting only inside x_t's document."""
    T, W = x_BTC.shape[1], w_C1W.shape[-1]
    w_CW = w_C1W.to(x_BTC.dtype)[:, 0].flip(-1)  # w_CW[:, s] multiplies x_{t-s}
    y = x_BTC * w_CW[:, 0]
    for s in range(1, min(W, T)):
        x_s = F.pad(x_BTC, (0, 0, s, 0))[:, :T]
        if doc_id_BT is not None:
            same_BT = F.pad((doc_id_BT[:, s:] == doc_id_BT[:, :-s]).to(x_s.dtype), (s, 0))
            x_s = x_s * same_BT.unsqueeze(-1)
        y = y + x_s * w_CW[:, s]
    return F.silu(y)
