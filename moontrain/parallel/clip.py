"""Gradient clipping by the true global norm, each parameter counted exactly once across meshes.

Dense params under FSDP are DTensor shards over the whole world: the squared norms of the local
shards are summed over the world. Expert masters hold this rank's local rows, replicated over the
dp_replicate axis: their squared norms are summed over the EP group only (the replicas hold the same
rows). Unsharded dense params (no FSDP) are identical on every rank and are counted locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moontrain.parallel.layout import ParallelLayout


@torch.no_grad()
def clip_grad_norm_global(dense: list[torch.Tensor], experts: list[torch.Tensor], layout: ParallelLayout,
                          max_norm: float) -> torch.Tensor:
    """Returns the global norm before clipping; scales all grads in place when max_norm > 0."""
    dev = layout.device
    sharded_sq = torch.zeros((), device=dev, dtype=torch.float32)
    replicated_sq = torch.zeros((), device=dev, dtype=torch.float32)
    for p in dense:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            sharded_sq += p.grad.to_local().float().pow(2).sum()
        else:
            replicated_sq += p.grad.float().pow(2).sum()
    expert_sq = torch.zeros((), device=dev, dtype=torch.float32)
    for p in experts:
        if p.grad is not None:
            expert_sq += p.grad.float().pow(2).sum()
    if layout.distributed:
        dist.all_reduce(sharded_sq, group=layout.world_group)
        if layout.ep > 1:
            dist.all_reduce(expert_sq, group=layout.ep_group)
    total = (sharded_sq + replicated_sq + expert_sq).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in dense + experts:
            if p.grad is not None:
                if isinstance(p.grad, DTensor):
                    p.grad.to_local().mul_(coef)
                else:
                    p.grad.mul_(coef)
    return total
