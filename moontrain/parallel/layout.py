"""The parallel layout: world = dp_replicate * ep, EP ranks borrowed from data parallel (torchtitan efsdp).

Rank r sits at (dp_replicate index r // ep, ep index r % ep): the ranks of one EP group are contiguous
(on one host when ep <= GPUs per host, so the symmetric heap can use NVLink). With ep_hosts = N > 1
(hierarchical EP) EP index i is rank i % (ep / N) of host i // (ep / N): the host groups (moonep's
groups, contiguous ranks, one host each) and the rail groups (one rank per host) come from
moonep.hierarchical.host_groups. Dense parameters are
sharded with FSDP over the whole world (parallel.dense=fsdp); expert local rows are replicated over the dp_replicate axis
(the expert-data-parallel group: same ep index, every replica) and reduced there explicitly.

FSDP2 on CPU: gloo in this torch (2.13) implements reduce_scatter and all_gather_into_tensor, so
fully_shard runs unchanged on CPU (checked by the EP-equality test, which runs with FSDP on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moonep import host_groups
from moontrain.model.experts import ExpertPlacement


@dataclass(kw_only=True)
class ParallelLayout:
    world_size: int
    rank: int
    ep: int
    device: torch.device
    mesh: DeviceMesh | None = None  # 2-D (dp_replicate, ep)
    fsdp_mesh: DeviceMesh | None = None  # 1-D over the whole world
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    world_group: dist.ProcessGroup | None = None
    ep_hosts: int = 1
    ep_host_group: dist.ProcessGroup | None = None  # hierarchical EP: this host's ep / ep_hosts ranks
    ep_rail_group: dist.ProcessGroup | None = None  # hierarchical EP: the same host rank on every host

    @property
    def dp_replicate(self) -> int:
        return self.world_size // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def expert_placement(self) -> ExpertPlacement:
        """The expert rows this rank's model holds (K3Model's placement)."""
        return ExpertPlacement(ep_rank=self.ep_rank, ep=self.ep)

    @property
    def dp_replicate_rank(self) -> int:
        return self.rank // self.ep

    @property
    def distributed(self) -> bool:
        return self.world_group is not None

    def describe(self, dense: str = "fsdp") -> str:
        """One line for the startup log; `dense` is parallel.dense."""
        dense_line = {"fsdp": f"FSDP over {self.world_size} ranks",
                      "allreduce": "fp32 on every rank, grads all-reduced (no FSDP)",
                      "plain": "plain (compute-dtype copies cast once per step, no FSDP)"}[dense]
        hier = (f" over {self.ep_hosts} hosts of {self.ep // self.ep_hosts} (hierarchical)"
                if self.ep_hosts > 1 else "")
        return (f"world={self.world_size} = dp_replicate {self.dp_replicate} x ep {self.ep}; "
                f"dense params: {dense_line}; experts: {self.ep}-way EP{hier}, "
                f"expert-data-parallel over {self.dp_replicate} replicas")


def single_process_layout(device: torch.device) -> ParallelLayout:
    """No process group: everything local (the reference the distributed runs are tested against)."""
    return ParallelLayout(world_size=1, rank=0, ep=1, device=device)


def build_layout(ep: int, device: torch.device, ep_hosts: int = 1) -> ParallelLayout:
    """Collective: builds the meshes (and with ep_hosts > 1 the host and rail groups) over the
    already-initialised default process group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ep:
        raise ValueError(f"world size {world} is not divisible by parallel.ep={ep}; use a multiple of {ep} ranks")
    if ep % ep_hosts:
        raise ValueError(f"parallel.ep_hosts={ep_hosts} does not divide parallel.ep={ep}")
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp_replicate", "ep"))
    fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    host_group = rail_group = None
    if ep_hosts > 1:
        ep_groups = [list(range(d * ep, (d + 1) * ep)) for d in range(world // ep)]
        host_group, rail_group = host_groups(ep_groups, ep // ep_hosts)
    return ParallelLayout(world_size=world, rank=rank, ep=ep, device=device, mesh=mesh, fsdp_mesh=fsdp_mesh,
                          ep_group=mesh.get_group("ep"), edp_group=mesh.get_group("dp_replicate"),
                          world_group=dist.group.WORLD, ep_hosts=ep_hosts, ep_host_group=host_group,
                          ep_rail_group=rail_group)
