"""One NCCL process group for the whole multigpu session (re-initialising per module races on the
store port under torchrun)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def group() -> dist.ProcessGroup:
    if "LOCAL_RANK" not in os.environ:
        pytest.skip("run under torchrun --nproc_per_node=2 (one process per GPU)")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=120))
    yield dist.group.WORLD
    dist.destroy_process_group()
