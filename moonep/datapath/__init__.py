"""The data path of a Buffer and its ExpertPools: one interface, two implementations, chosen once
when the Buffer is built (BufferOptions.kernels).

- `reference.ReferencePath`: pure PyTorch, any device. The specification: every kernel of the other
  path is tested bitwise against it (tests/moonep/kernels/*_interpreted.py in Triton's interpreter,
  the *_gpu.py and *_multigpu.py tests of tests/moonep on the GPU).
- `triton_path.TritonPath`: the Triton kernels (moonep.kernels) and the fused planner
  (moonep.planner.fused); CUDA only, imported only there (CPU machines need no triton).

Buffer owns the protocol around the path (input checks, the histogram, the barriers between the
sender and the receiver halves of dispatch, the async calls); ExpertPools owns the views and the
streams; `moonep.expert_glu` strings the math together. A path only moves and computes, through the
methods of `DataPath`.

The interface (CommViews, DataPath) lives in moonep.datapath.interface.
"""

from __future__ import annotations

import torch

from moonep.datapath.interface import CommViews, DataPath

__all__ = ["CommViews", "DataPath", "build_path", "resolve_kernels"]


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """'torch' or 'triton' for a buffer on `device` (BufferOptions validated the name)."""
    if kernels == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if kernels == "triton" and device.type != "cuda":
        raise ValueError(f"BufferOptions.kernels='triton' needs a CUDA buffer, this one is on {device}; "
                         "use kernels='torch' or 'auto' on the CPU")
    return kernels


def build_path(kind: str, comm: CommViews) -> DataPath:
    """The path `kind` ('torch' or 'triton', see resolve_kernels) over a Buffer's comm views."""
    if kind == "triton":
        from moonep.datapath.triton_path import TritonPath  # imports triton: CUDA machines only

        return TritonPath(comm)
    from moonep.datapath.reference import ReferencePath

    return ReferencePath(comm)
