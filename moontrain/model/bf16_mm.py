"""a @ b for bf16 operands accumulated in fp32 and rounded once to the output dtype: the router's GEMMs
(moontrain.model.router's RouterLogits, moontrain.model.router_kernel's RoutedScores)."""

from __future__ import annotations

import torch


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS on CUDA (aten::mm.dtype for an output dtype other than the operands'); on the CPU (no
    aten::mm.dtype there) the same products in fp32, the specification the CUDA call is tested against."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype) if out_dtype != a.dtype else torch.mm(a, b)
    return (a.float() @ b.float()).to(out_dtype)
