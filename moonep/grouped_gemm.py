"""Grouped GEMMs over expert row groups (the `offs` format of torch._grouped_mm).

offs[g] is the cumulative end of group g's rows; rows past offs[-1] are padding that no caller
reads. The weight gradient is accumulated in fp32 into the grad mirror.
"""

from __future__ import annotations

import torch


def grouped_mm(x_rows: torch.Tensor, w_GIO: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w[g]  -> [rows, O] in x's dtype."""
    return torch._grouped_mm(x_rows, w_GIO, offs=offs)


def grouped_mm_wgrad(x_rows: torch.Tensor, grad_rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dW[g] = x[rows of g]^T @ grad[rows of g] -> [G, I, O], fp32-accumulated: bf16 on CUDA (torch
    2.11's CUDA kernel writes only the input dtype), fp32 on the CPU. Adding it to an fp32 grad gives
    the same values either way; on CUDA without an fp32 temporary of the weights' size."""
    if x_rows.is_cuda:
        return torch._grouped_mm(x_rows.t(), grad_rows, offs=offs)
    # the CPU kernel only writes x's dtype; bf16 products are exact in fp32, so upcasting first
    # gives the fp32-accumulated result the GPU kernel produces
    return torch._grouped_mm(x_rows.t().float(), grad_rows.float(), offs=offs)


def accumulate_wgrad(g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor, offs: torch.Tensor,
                     scale: float = 1.0) -> None:
    """g (fp32) += scale * x^T grad per group (in place, with type promotion)."""
    g_GIO.add_(grouped_mm_wgrad(x_rows, grad_rows, offs), alpha=scale)
