"""train.deterministic: bitwise-reproducible training (two identical runs, and stop/resume vs one run).

The audit of every op of the step is docs/determinism.md. On CUDA almost every kernel of the step is
deterministic already (no float atomics, or atomics that add into distinct locations); what is not, and
its deterministic path:

- attention backward: cuDNN, memory-efficient and flash SDPA accumulate dQ with atomics. The model sends
  causal attention on CUDA through flex_attention (its Triton backward writes dQ per query block and
  dK/dV per key block): K3Model.deterministic_attention, set by the trainer.
- per-process autotuning, whose choice changes the summation order: inductor's reduction configs
  (torch._inductor.config.deterministic: heuristics, no benchmarking) and fla's KDA kernels (their
  choices are cached on disk by Triton, so every process of the machine reuses the first one's; needs
  FLA_CACHE_RESULTS=1, fla's default).
- cuBLAS keeps its choices per workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8 (set by the worker before CUDA
  initialises); cuDNN deterministic / benchmark=False for completeness (no convolution runs).

torch.use_deterministic_algorithms (the strict flag) is not set on CUDA: it swaps deterministic kernels for
slower sort-based ones (index_copy, scatter_add_, index_add_), fills every new tensor with NaN, and runs
memory-efficient attention at one key split. It is the strict checker (strict=True: torch raises on any op
without a deterministic implementation; the GPU test compares it with this mode bitwise). On the CPU it is
on: CPU index_put_(accumulate=True) and index_add_ accumulate in threads, unordered, and the flag's serial
kernels cost little there.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def set_cublas_workspace() -> None:
    """Before the first cuBLAS call (the worker calls it before CUDA initialises)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def check_fla_autotune_cache() -> None:
    """fla autotunes its KDA kernels per process; only the on-disk cache makes processes agree."""
    value = os.environ.get("FLA_CACHE_RESULTS", "1")
    if value != "1":
        raise ValueError(f"train.deterministic=true needs fla's autotune results cached on disk, but "
                         f"FLA_CACHE_RESULTS={value!r}; unset it (fla's default is 1) so that every process "
                         "reuses the same KDA kernel configurations")


def enable_determinism(device: torch.device, *, kda_fla: bool = False, strict: bool = False) -> None:
    """Process-wide switches of deterministic mode for a run on `device` (the model's attention path is
    K3Model.deterministic_attention). kda_fla: the model runs fla's KDA kernels. strict: also torch's
    deterministic algorithms on CUDA (slow; raises on an op without a deterministic implementation)."""
    if kda_fla:
        check_fla_autotune_cache()
    set_cublas_workspace()
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    if strict or device.type == "cpu":
        torch.use_deterministic_algorithms(True)


def determinism_state() -> dict[str, bool]:
    """The switches enable_determinism sets (for tests and the run's startup line)."""
    import torch._inductor.config as inductor_config

    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "inductor_deterministic": bool(inductor_config.deterministic),
            "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG") == CUBLAS_WORKSPACE}
