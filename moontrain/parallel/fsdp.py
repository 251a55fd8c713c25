"""Dense parameters: FSDP2 fully_shard per block and at the root (parallel.dense=fsdp), or whole on every rank
with all-reduced grads (parallel.dense=allreduce); expert masters are ignored by both.

The expert masters never take part in forward (the backends read the compute tensors), and their
grads are reduced over the expert-data-parallel group by ExpertWeights.reduce_grads, so FSDP must not
shard, gather or reduce them: they are passed as ignored_params. GPU: bf16 compute, fp32 reduction.
CPU: fp32 throughout (gloo has no bf16 reduction worth using, and CPU bf16 matmuls are slow).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moontrain.model.transformer import K3Model
from moontrain.parallel.layout import ParallelLayout


def expert_master_params(model: nn.Module) -> set[nn.Parameter]:
    return {p for name, p in model.named_parameters() if ".experts.master." in name}


def apply_fsdp(model: K3Model, layout: ParallelLayout, param_dtype: torch.dtype,
               reshard_after_forward: bool = True) -> None:
    """Shard every block, then the root (embedding, final norm, head; FSDP keeps the root gathered
    after forward). reshard_after_forward=False keeps the blocks gathered from forward to backward."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    ignored = expert_master_params(model)
    for block in model.layers:
        fully_shard(block, mesh=layout.fsdp_mesh, mp_policy=mp, ignored_params=ignored & set(block.parameters()),
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=layout.fsdp_mesh, mp_policy=mp, ignored_params=ignored)


@torch.no_grad()
def allreduce_dense_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """parallel.dense=allreduce: the plain data-parallel mean of the dense grads."""
    world = dist.get_world_size(group)
    ignored = expert_master_params(model)
    for p in model.parameters():
        if p.grad is not None and p not in ignored:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)
