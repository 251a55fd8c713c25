"""The auto / torch / triton choice of a KernelsConfig field (kernels.short_conv, kernels.attn_res,
kernels.lm_loss): which implementation a layer built on a device runs."""

from __future__ import annotations

import importlib.util
import os

import torch


def runs_triton(option: str, choice: str, device: torch.device | str | None, torch_path: str) -> bool:
    """Whether kernels.<option> = `choice` runs its Triton kernels on `device`: "auto" picks them on CUDA and the
    PyTorch path (`torch_path`, named in the error) elsewhere; "triton" needs triton importable."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not on_cuda):
        return False
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"kernels.{option}=triton needs triton (installed with torch's CUDA builds); "
                         f"kernels.{option}=torch runs {torch_path}")
    return True


def runs_cuda_kernels(option: str, choice: str, device: torch.device | str | None, torch_path: str) -> bool:
    """runs_triton for kernels that have no CPU path: "triton" on another device than CUDA is refused with the
    fix, except in Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    if not runs_triton(option, choice, device, torch_path):
        return False
    if (device is None or torch.device(device).type != "cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernels.{option}=triton runs on a CUDA device (or in Triton's interpreter, "
                         f"TRITON_INTERPRET=1), this model is on {device}; kernels.{option}=auto picks "
                         f"{torch_path} there")
    return True
