"""The sharded expert state on 2 GPUs (NCCL): dp_replicate 2 x EP 1, the `local` backend. The expert grads'
in-place reduce-scatter, the norm's all-gather and the compute rows' in-place bf16 all-gather run on NCCL;
sharded == unsharded bitwise (losses, grad norms, gathered masters, compute copies, Adam state; D = 2, so each
grad element is a + b in both modes) and checkpoints resume across the setting, exactly as the CPU test
(tests/moontrain/parallel/test_shard_expert_state.py, train.deterministic on here).

    torchrun --nproc_per_node=2 -m pytest -q -m multigpu tests/moontrain/parallel/test_shard_expert_state_multigpu.py
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.moontrain.parallel.test_shard_expert_state import sharded_vs_unsharded

pytestmark = pytest.mark.multigpu


def test_sharded_equals_unsharded_on_two_gpus(tmp_path: Path) -> None:
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        pytest.skip("run under torchrun --nproc_per_node=2 (one process per GPU)")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=300))
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        if dist.get_world_size() != 2:
            pytest.skip("needs exactly 2 ranks")
        run_dir = [str(tmp_path)]  # every rank writes and reads rank 0's directory
        dist.broadcast_object_list(run_dir, src=0)
        sharded_vs_unsharded(dist.get_rank(), 2, "local", 1, run_dir[0], device)
    finally:  # train.deterministic switches it on process-wide
        torch.use_deterministic_algorithms(deterministic)
        dist.destroy_process_group()
