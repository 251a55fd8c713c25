"""Host side shared by the gated-activation kernels (moonep.kernels.swiglu, .situ_glu): one program per
BLOCK elements of the flattened [N, F] tensors, with the same checks for every activation.

A forward kernel takes (h, u, a, n, BLOCK); a backward kernel (grad_a, h, u, grad_h, grad_u, a, n, BLOCK).
"""

from __future__ import annotations

import torch
import triton

_BLOCK = 2048
_WARPS = 8


def check_glu_inputs(name: str, *tensors: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """ValueError unless the tensors are contiguous, of one shape and one dtype (`dtype` if given)."""
    first = tensors[0]
    want = first.dtype if dtype is None else dtype
    if not all(t.shape == first.shape and t.dtype == want and t.is_contiguous() for t in tensors):
        kind = "" if dtype is None else f"{str(dtype).removeprefix('torch.').replace('bfloat16', 'bf16')} "
        raise ValueError(f"{name} needs contiguous {kind}tensors of one shape and dtype, got "
                         + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors))


def launch_forward(kernel, name: str, h: torch.Tensor, u: torch.Tensor, dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """a = kernel(h, u) elementwise, in h's dtype."""
    check_glu_inputs(name, h, u, dtype=dtype)
    a = torch.empty_like(h)
    n = h.numel()
    kernel[(triton.cdiv(n, _BLOCK),)](h, u, a, n, BLOCK=_BLOCK, num_warps=_WARPS)
    return a


def launch_backward(kernel, name: str, grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_u, a) = kernel(grad_a, h, u) elementwise, in h's dtype."""
    grad_a = grad_a.contiguous()
    check_glu_inputs(name, grad_a, h, u, dtype=dtype)
    grad_h, grad_u, a = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
    n = h.numel()
    kernel[(triton.cdiv(n, _BLOCK),)](grad_a, h, u, grad_h, grad_u, a, n, BLOCK=_BLOCK, num_warps=_WARPS)
    return grad_h, grad_u, a
