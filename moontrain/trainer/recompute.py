"""The layers a run recomputes in backward (train.activation_checkpointing), chosen at launch.

true, false and a number of layers name them (moontrain.planning.activations); "auto" takes the fewest layers
whose memory estimate fits the GPU (moontrain.planning.memory.planned_recompute): none where the whole pass
fits (k3_small at EP = 1 on an H200), the KDA layers first on a smaller GPU. Every rank takes the same layers
(a recomputed forward re-runs the experts' collectives, so the ranks must agree): the smallest GPU of the job
decides. On CPU "auto" recomputes nothing (the launch compares the host's memory with the estimate instead).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moontrain.config.run_config import RunConfig
from moontrain.model.params import count_params
from moontrain.parallel.layout import ParallelLayout
from moontrain.planning.activations import describe_recompute
from moontrain.planning.memory import AUTO_SHARE, estimate_memory, planned_recompute


def recomputed_layers(cfg: RunConfig, layout: ParallelLayout, compute_bytes: int) -> tuple[int, ...]:
    """Collective for "auto" on a GPU job with a process group (one all_reduce of the GPUs' memory)."""
    counts = count_params(cfg.model)
    device = layout.device
    if cfg.train.activation_checkpointing != "auto" or device.type != "cuda":
        return planned_recompute(cfg, counts, layout.world_size, compute_bytes, None)
    have = torch.tensor(float(torch.cuda.get_device_properties(device).total_memory), dtype=torch.float64,
                        device=device)
    if layout.distributed:
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=layout.world_group)
    gpu_bytes = have.item()
    layers = planned_recompute(cfg, counts, layout.world_size, compute_bytes, gpu_bytes)
    if layout.rank == 0:
        need = estimate_memory(cfg, counts, layout.world_size, compute_bytes, layers).total
        budget = AUTO_SHARE * gpu_bytes
        print(f"moontrain: train.activation_checkpointing=auto: {describe_recompute(cfg, layers)}; memory estimate "
              f"{need / 2**30:.1f} GiB a rank, {'within' if need <= budget else 'ABOVE'} {budget / 2**30:.1f} GiB "
              f"({AUTO_SHARE:.0%} of the GPU's {gpu_bytes / 2**30:.1f} GiB)", flush=True)
    return layers
