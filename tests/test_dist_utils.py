"""run_ranks: results in rank order, a rank's traceback reaches the parent, hangs end in bounded time."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks


def _rank_info(rank: int, world_size: int, offset: int) -> dict:
    # all_reduce checks that the gloo group really joins all ranks.
    sum_1 = torch.tensor([rank + offset], dtype=torch.int64)
    dist.all_reduce(sum_1)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": int(sum_1.item()),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "tensor": torch.arange(3) * rank,
    }


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError(f"deliberate failure on rank {rank} of {world_size}")
    return rank


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_ranks(_rank_info, world_size, 10)
    expected_sum = sum(rank + 10 for rank in range(world_size))
    for rank, info in enumerate(results):
        assert info["rank"] == rank
        assert info["world_size"] == world_size
        assert info["sum"] == expected_sum
        assert info["omp"] == "1"
        assert info["threads"] == 1
        assert torch.equal(info["tensor"], torch.arange(3) * rank)


def test_raising_rank_traceback_reaches_parent() -> None:
    with pytest.raises(AssertionError, match="1 of 2 ranks failed") as excinfo:
        run_ranks(_raise_on_rank_1, 2, timeout_s=60)
    message = str(excinfo.value)
    assert "rank 1 of 2 raised" in message
    assert "Traceback (most recent call last)" in message
    assert "RuntimeError: deliberate failure on rank 1 of 2" in message
    assert "in _raise_on_rank_1" in message
    assert "rank 0 of 2 raised" not in message


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_silently_dying_rank_is_reported_with_exit_code() -> None:
    with pytest.raises(AssertionError, match="process exited with code 3 without a report"):
        run_ranks(_exit_on_rank_1, 2, timeout_s=60)


def test_hanging_rank_times_out_in_bounded_time() -> None:
    timeout_s = 10.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 still alive after timeout_s=10 s; killed"):
        run_ranks(_hang_on_rank_1, 2, timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + 10.0
    assert multiprocessing.active_children() == []
