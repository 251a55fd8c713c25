"""train.deterministic: bitwise-reproducible GPU training (two identical runs, and stop/resume vs one run).

What is non-deterministic by default, and its deterministic path here:

- SDPA backward. cuDNN's attention backward accumulates dQ with atomics and has no deterministic mode:
  it is switched off (torch.backends.cuda.enable_cudnn_sdp(False)). Flash attention (taken when the
  head dims are equal, e.g. model.attn_pad_head_dims=true) and memory-efficient attention run their
  deterministic backward under torch.use_deterministic_algorithms (FA2's `deterministic` flag; a
  single key split for memory-efficient attention).
- index_add_ / index_put_(accumulate=True) / scatter_add_ / gather backward / embedding backward on
  CUDA (the router's score gather, the local and all-to-all backends' token gather and scatter, the
  PyTorch reduce_grad path of moonep) accumulate floats with atomics: use_deterministic_algorithms
  selects torch's sorted (segment-reduce) implementations. The same flag makes torch raise on any op
  that has no deterministic implementation, so a new one cannot slip in silently.
- cuBLAS picks reduction splits per workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8 (set by the worker
  before CUDA initialises; required by use_deterministic_algorithms).
- cuDNN convolutions are not used; cudnn.deterministic / benchmark=False are set for completeness.
- torch.compile: inductor's deterministic mode (no on-device autotuning, whose choice can differ
  between runs).

Deterministic already, nothing to do: moonep's Triton kernels (their atomics are integer work tickets
and a last-program counter; every float sum has one fixed order, bitwise equal to the PyTorch
specification: combine adds a token's K rows in ascending k, reduce_grad folds slot rows in slot
order), integer counts (bincount without weights, index_add_ of ones), fused AdamW, torch._foreach_norm,
RMSNorm and cross-entropy. NCCL reductions are deterministic at a fixed world size and message sizes.

Not covered: the KDA layers' fla kernels (model.kda_*), whose chunked backward has not been audited.
Cost and the bitwise checks on GPUs: benchmarks/check_determinism.py (docs/faults.md). Off by default.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def set_cublas_workspace() -> None:
    """Before the first cuBLAS call (the worker calls it before CUDA initialises)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def enable_determinism() -> None:
    """Process-wide: deterministic kernels everywhere torch has them, errors where it has none."""
    set_cublas_workspace()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True


def determinism_state() -> dict[str, bool]:
    """The switches enable_determinism sets (for tests and the run's startup line)."""
    import torch._inductor.config as inductor_config

    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
            "inductor_deterministic": bool(inductor_config.deterministic)}
