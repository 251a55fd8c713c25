"""The process groups of moonep's GPU tests, one fixture each (CPU tests spawn their own gloo ranks through
tests/dist_utils.py):
- `group`: one NCCL group for the whole multigpu session under torchrun (re-initialising per module races
  on the store port under torchrun); skips without torchrun;
- `one_rank` (tests/conftest.py): this process as a one-rank NCCL group, for the single-GPU tests.
A failure of a gpu or multigpu test is printed as it happens (a failure on one rank can leave the other
waiting in a collective until the step's time limit, and pytest prints its summary only at the end).
"""

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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and ("gpu" in report.keywords or "multigpu" in report.keywords):
        print(f"\n[failure, rank {os.environ.get('RANK', '?')}] {report.nodeid} ({report.when}):\n"
              f"{report.longreprtext}\n", flush=True)
