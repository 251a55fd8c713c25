"""Parallel layout configuration: expert parallel degree and precision; data parallel is derived."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "fsdp": "write parallel.dense=fsdp|allreduce|plain instead (parallel.fsdp=true was parallel.dense=fsdp, "
                "the default; parallel.fsdp=false was parallel.dense=allreduce)"}

    ep: int = 1  # expert-parallel degree; dp_replicate = world_size // ep is derived, never set
    # hosts one EP group spans (hierarchical EP, experts.backend=moonep only): ep / ep_hosts ranks per host
    # run moonep among themselves, rows cross hosts through all-to-alls (moonep.hierarchical, docs/scale.md)
    ep_hosts: int = 1
    # how the dense (non-expert) parameters are held and their grads reduced (dense_at resolves auto):
    #   auto (default): plain at world size 1 (FSDP over one rank shards nothing and costs per-pass work), else fsdp
    #   fsdp: FSDP2 over the whole world, compute-dtype copies gathered per block, fp32 grads reduce-scattered
    #     (moontrain.parallel.fsdp; without a process group the model runs as built, in fp32)
    #   allreduce: every rank holds the fp32 parameters whole and runs them as they are; their grads are
    #     all-reduced (mean) after backward (moontrain.parallel.fsdp.allreduce_dense_grads)
    #   plain (world size 1 only): fp32 masters as plain tensors, their compute-dtype copies cast once per step
    #     with one foreach copy, each pass's grads added into fp32 with foreach ops (moontrain.parallel.plain_dense):
    #     FSDP2's world-1 numerics bit for bit, without its per-parameter, per-pass work
    dense: Literal["auto", "fsdp", "allreduce", "plain"] = "auto"
    # dense=plain: how a pass after a step's first adds its compute-dtype grads into the fp32 accumulators:
    # "torch", a foreach copy into an fp32 scratch and a foreach add; "triton", one Triton launch reading each
    # grad once (moontrain.parallel.grad_accumulate_kernel; CUDA, or Triton's interpreter), the same values;
    # "auto" (default), triton on CUDA, torch elsewhere (docs/performance.md: 1.38x per pass)
    plain_accumulate: Literal["auto", "torch", "triton"] = "auto"
    # dense=fsdp. False keeps each block's gathered (bf16) dense parameters from forward to backward, and, with
    # gradient accumulation, from one pass to the next: one all-gather per block per optimizer step instead of
    # two per pass, for the memory of the unsharded dense parameters (small next to the experts in a K3-like
    # MoE: 0.8 GiB in k3_small_moe, whose experts hold ~80 GB per rank)
    fsdp_reshard_after_forward: bool = True
    # auto: bf16 compute with fp32 reduction on GPU, fp32 everywhere on CPU
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # seconds a collective may wait before the process group fails it (NCCL / gloo timeout)
    timeout_s: float = 600.0
    # seconds without a heartbeat after which a rank is named as dead or frozen and the job aborts
    # (moontrain.parallel.heartbeat); 0 disables the heartbeat
    heartbeat_timeout_s: float = 120.0
    # split each EP rank's expert fp32 masters and optimizer state over the dp_replicate replicas (the expert
    # grads are reduce-scattered to them, each steps epn / dp_replicate experts and all-gathers the compute
    # rows); needs epn % dp_replicate == 0, plain AdamW (not write_back, not muon)
    shard_expert_state: bool = False

    def __post_init__(self) -> None:
        if self.plain_accumulate not in ("auto", "torch", "triton"):
            raise ValueError(f"parallel.plain_accumulate must be 'auto', 'torch' or 'triton', got "
                             f"{self.plain_accumulate!r}")
        if self.ep < 1:
            raise ValueError(f"parallel.ep must be >= 1, got {self.ep}")
        if self.ep_hosts < 1 or self.ep % self.ep_hosts:
            raise ValueError(f"parallel.ep_hosts={self.ep_hosts} must be >= 1 and divide parallel.ep={self.ep} (the EP "
                             f"group spans ep_hosts hosts of ep / ep_hosts ranks each); use a divisor of {self.ep}")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"parallel.timeout_s must be a finite number of seconds > 0, got {self.timeout_s}")
        if not 0 <= self.heartbeat_timeout_s < self.timeout_s:
            raise ValueError(f"parallel.heartbeat_timeout_s={self.heartbeat_timeout_s} must be >= 0 (0 disables) and "
                             f"below parallel.timeout_s={self.timeout_s}, so the heartbeat names a dead rank before "
                             "the collective times out")

    def dense_at(self, world_size: int, distributed: bool = True) -> str:
        """The dense mode a job of world_size ranks runs (parallel.dense with auto resolved): auto is plain at one
        rank under a process group (FSDP2's world-1 numerics bit for bit, without its per-parameter work), fsdp
        otherwise (without a process group fsdp runs the model as built)."""
        if self.dense != "auto":
            return self.dense
        return "plain" if world_size == 1 and distributed else "fsdp"
