"""Where an EP group may lie: moonep's group inside one host, rejected before launch, in --dry-run and at start."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from moontrain.cli import main
from moontrain.parallel.hosts import check_ep_domain, check_ep_group_hosts
from tests.dist_utils import run_ranks


@pytest.mark.parametrize(("backend", "ep", "per_host", "ok"), [
    ("moonep", 8, 8, True), ("moonep", 4, 8, True), ("moonep", 1, 1, True), ("alltoall", 896, 8, True),
    ("moonep", 16, 8, False), ("moonep", 3, 8, False), ("moonep", 128, 8, False),
])
def test_check_ep_domain(backend: str, ep: int, per_host: int, ok: bool) -> None:
    if ok:
        check_ep_domain(backend, ep, per_host)
    else:
        with pytest.raises(ValueError, match=f"parallel.ep={ep} does not divide the {per_host} processes per host"):
            check_ep_domain(backend, ep, per_host)


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "8", "--nnodes", "112", "experts.backend=moonep", "parallel.ep=128"],
     "experts.backend=moonep needs its EP group inside one host"),
    (["--nproc", "896", "experts.backend=moonep", "parallel.ep=896"], "the GPU dry-run plans H200 hosts of 8 GPUs"),
    (["--nproc", "512"], "the GPU dry-run plans H200 hosts of 8 GPUs"),
])
def test_dry_run_rejects_cross_host_moonep(args: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3.yaml", "--dry-run", "--device", "cuda", *args]) == 2
    assert message in capsys.readouterr().err


def _hosts_case(rank: int, world_size: int, split: bool) -> str:
    if split:  # rank 1 pretends to run on another host
        socket.gethostname = lambda: f"host{rank}"  # type: ignore[assignment]
    try:
        check_ep_group_hosts(dist.group.WORLD, "moonep")
    except ValueError as err:
        return str(err)
    return "ok"


def test_start_time_check_names_the_hosts() -> None:
    assert run_ranks(_hosts_case, 2, False, timeout_s=120) == ["ok", "ok"]
    for message in run_ranks(_hosts_case, 2, True, timeout_s=120):
        assert "the group spans hosts (rank 0: host0, rank 1: host1)" in message, message
