"""GPU kernels of moonep's data path. Importing this package never imports triton: the kernel
modules are imported lazily by `Buffer` on CUDA only, so CPU machines need no triton.

kernels="torch" runs the pure-PyTorch path (the specification, any device); "triton" the kernels of
`moonep.kernels.dispatch_combine` (CUDA only); "auto" picks triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

import torch

KERNEL_CHOICES = ("auto", "torch", "triton")


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """'torch' or 'triton' for a buffer on `device` (BufferConfig.kernels validated the name)."""
    if kernels == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if kernels == "triton" and device.type != "cuda":
        raise ValueError(f"BufferConfig.kernels='triton' needs a CUDA buffer, this one is on {device}; "
                         "use kernels='torch' or 'auto' on the CPU")
    return kernels
