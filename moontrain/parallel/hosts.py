"""Where an expert-parallel group may lie: moonep's group inside one host, checked before launch and at start.

moonep's symmetric heap exchanges memory handles over local Unix sockets and synchronises through
device memory that every rank of the group maps over NVLink, so one moonep EP group must be a set of
ranks of one host (one NVLink domain). Ranks are placed host by host (torchrun's node-major order) and
an EP group is a contiguous run of ep ranks (parallel/layout.py), so the group lies inside a host exactly
when ep divides the processes per host. The all-to-all backend goes through NCCL and may span hosts.
With parallel.ep_hosts = N > 1 the EP group spans N hosts (hierarchical EP, moonep.hierarchical): the
moonep group is each host's ep / N ranks, and the rows cross hosts through NCCL all-to-alls.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

H200_HOST_GPUS = 8  # an HGX H200 host: one NVLink domain of 8 GPUs (the --dry-run target)


def check_ep_domain(backend: str, ep: int, procs_per_host: int, ep_hosts: int = 1) -> None:
    """Config-time check (launch and --dry-run): a moonep group (the whole EP group, or with ep_hosts > 1
    each host's ep / ep_hosts ranks of it) must fit inside one host."""
    local = ep // ep_hosts
    if backend != "moonep" or local == 1:
        return
    if local > procs_per_host or procs_per_host % local:
        if ep_hosts > 1:
            raise ValueError(
                f"parallel.ep={ep} over parallel.ep_hosts={ep_hosts} hosts puts {local} ranks of the EP group on each "
                f"host, which does not divide the {procs_per_host} processes per host; choose ep / ep_hosts among "
                f"the divisors of {procs_per_host} (e.g. parallel.ep={procs_per_host * ep_hosts})"
            )
        raise ValueError(
            f"experts.backend=moonep needs its EP group inside one host (NVLink domain), but parallel.ep={ep} "
            f"does not divide the {procs_per_host} processes per host; use a parallel.ep that divides "
            f"{procs_per_host}, set parallel.ep_hosts to the hosts it spans (ep / ep_hosts dividing {procs_per_host}: "
            f"hierarchical EP), or experts.backend=alltoall"
        )


def check_dry_run_host(device: str, procs_per_host: int) -> None:
    """The GPU dry-run plans H200 hosts: more processes per host than GPUs in one is a plan no cluster runs."""
    if device == "cuda" and procs_per_host > H200_HOST_GPUS:
        raise ValueError(
            f"--nproc {procs_per_host} processes per host: the GPU dry-run plans H200 hosts of {H200_HOST_GPUS} "
            f"GPUs; give the cluster as --nproc {H200_HOST_GPUS} --nnodes N"
        )


def check_ep_group_hosts(ep_group: dist.ProcessGroup | None, backend: str) -> None:
    """Start-time check (collective over the EP group): every rank of a moonep group runs on this host."""
    if backend != "moonep" or ep_group is None or dist.get_world_size(ep_group) == 1:
        return
    hosts: list[str | None] = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(hosts, socket.gethostname(), group=ep_group)
    if len(set(hosts)) > 1:
        ranks = dist.get_process_group_ranks(ep_group)
        placement = ", ".join(f"rank {r}: {h}" for r, h in zip(ranks, hosts, strict=True))
        raise ValueError(
            f"experts.backend=moonep needs its EP group on one host, but the group spans hosts ({placement}); "
            f"set parallel.ep to a divisor of the GPUs per host, or use experts.backend=alltoall"
        )
