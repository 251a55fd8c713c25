"""Grouped GEMMs over expert row groups (the `offs` format of torch._grouped_mm).

offs[g] is the cumulative end of group g's rows; rows past offs[-1] are padding that no caller
reads. The weight gradient is produced in fp32 for the grad mirror.
"""

from __future__ import annotations

import torch


def grouped_mm(x_rows: torch.Tensor, w_GIO: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w[g]  -> [rows, O] in x's dtype."""
    return torch._grouped_mm(x_rows, w_GIO, offs=offs)


def grouped_mm_wgrad(x_rows: torch.Tensor, grad_rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dW[g] = x[rows of g]^T @ grad[rows of g] -> [G, I, O] fp32 (rounded through bf16 on CUDA)."""
    if x_rows.is_cuda:
        # torch 2.11's CUDA kernel writes only the input dtype: fp32 accumulation, bf16 result
        return torch._grouped_mm(x_rows.t(), grad_rows, offs=offs).float()
    # the CPU kernel only writes x's dtype; bf16 products are exact in fp32, so upcasting first
    # gives the fp32-accumulated result the GPU kernel produces
    return torch._grouped_mm(x_rows.t().float(), grad_rows.float(), offs=offs)


def accumulate_wgrad(g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor, offs: torch.Tensor) -> None:
    """g (fp32) += x^T grad per group, without an fp32 temporary of g's size on CUDA (the bf16
    result is added in place with type promotion: the same values as adding grouped_mm_wgrad's)."""
    if x_rows.is_cuda:
        g_GIO.add_(torch._grouped_mm(x_rows.t(), grad_rows, offs=offs))
    else:
        g_GIO.add_(grouped_mm_wgrad(x_rows, grad_rows, offs))
