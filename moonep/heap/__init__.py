"""Symmetric memory for moonep: one interface, a CPU (memfd) and a CUDA (VMM) backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moonep.heap.base import Mapping, Piece, Segment, SymmetricHeap, strided_view, view


def create_heap(group: dist.ProcessGroup, device: torch.device, *, timeout_s: float) -> SymmetricHeap:
    """A symmetric heap on `device` ('cpu' or 'cuda') over `group`."""
    if device.type == "cpu":
        from moonep.heap.cpu import CpuHeapBackend

        return SymmetricHeap(group, CpuHeapBackend(group), timeout_s=timeout_s)
    if device.type == "cuda":
        from moonep.heap.cuda import CudaHeapBackend

        return SymmetricHeap(group, CudaHeapBackend(group, device), timeout_s=timeout_s)
    raise ValueError(f"moonep has no symmetric heap for device {device}; use 'cpu' or 'cuda'")


__all__ = ["Mapping", "Piece", "Segment", "SymmetricHeap", "create_heap", "strided_view", "view"]
