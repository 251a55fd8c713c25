"""Hierarchical EP on 2 GPUs as 2 "hosts" of 1 GPU: the rows cross "hosts" through NCCL all-to-alls over
the rail group, each GPU is a host group of one rank with its own CUDA symmetric heap, and the results
equal the one-level layer over both GPUs with the bitwise statements of tests/moonep/test_hierarchical.py
(tests/moonep/helpers/hierarchical_case.py; the same case runs on CPU there as "2x1").

    torchrun --nproc_per_node=2 -m pytest -q -m multigpu tests/moonep/test_hierarchical_multigpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.moonep.helpers.hierarchical_case import Case, check_rank, run_case

pytestmark = pytest.mark.multigpu

# 512 local experts of 32 x 64 bf16 = 2 MiB per projection: the CUDA heap's mapping granularity. Small matrices
# keep every per-row reduction (GEMM, route-weight grad) short, so its bits should not depend on how many
# rows share the call (the one-level and the host-stage calls have different row counts; see
# tests/moonep/helpers/hierarchical_case.py)
CASE = Case(R=2, N=2, E=1024, H=32, F=64, K=4, S=32)


def test_two_hosts_of_one_gpu_equal_one_level(group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) != CASE.R:
        pytest.skip(f"needs exactly {CASE.R} ranks")
    rank = dist.get_rank(group)
    out = run_case(rank, CASE, torch.device("cuda", torch.cuda.current_device()))
    check_rank(CASE, rank, out)
