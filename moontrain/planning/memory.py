"""Per-rank memory estimate for a training layout, computed from shapes only (nothing is allocated).

Legend: W world, R = ep, epn = E/R, B = epn prefetch slots (training), S tokens per rank per step,
K top-k, H expert width, F expert FFN width, P dense parameters (FSDP-sharded unless parallel.dense says
otherwise).

Each row is split into the dense part (FSDP over W) and the expert part (this rank's local rows,
L_moe * epn * 3*H*F parameters, replicated over dp_replicate):
- weights: compute-dtype copies. Dense: the gathered root (embedding, head) plus two blocks (current
  and prefetched). Experts: the local rows (for moonep they live in the symmetric heap).
- master: fp32, dense 4P/W, experts 4 bytes per local parameter (with parallel.shard_expert_state: per
  parameter of the replica's 1/dp_replicate of the local rows, dp_replicate = W / R).
- grads: dense: the fp32 reduce-scatter output 4P/W plus the gathered compute-dtype grads of two
  blocks; experts: fp32 local rows (moonep: the grad mirror's local rows, in the heap).
- parallel.dense=plain (one rank): compute-dtype copies of all P, the fp32 accumulators and, from a step's
  second pass on, a bounded fp32 scratch unless the Triton accumulator adds in place (moontrain.parallel.
  plain_dense); a pass's compute-dtype grads (P of them) live from its backward to their accumulation, so they
  count in the activations row, beside the backward's activations only (none exist at the forward's end).
- parallel.dense=allreduce: every rank holds all P as fp32 masters and runs them as they are (no
  copies), with fp32 grads of all P and Adam's moments of all P (the dense activations, fp32 then, are
  still counted at the compute dtype).
- optimizer: Adam's two moments on the master, fp32 or bf16 (optim.state_dtype; sharded as the master; the
  expert grads and compute rows stay whole).
- symmetric heap (moonep, beyond the local weight/grad rows above): per projection B slot rows in the
  compute dtype and B reduce-pool rows in fp32, shared by all layers (B = epn, 0 at R = 1). The heap's
  regions (moonep.Layout.heap_bytes) are MemoryEstimate.heap: the memory outside the PyTorch allocator.
- receive buffers: moonep's comm segment (moonep.Layout.comm_bytes; static); alltoall S*K*H at balance
  (dynamic: up to R times that under full skew). Hierarchical EP (parallel.ep_hosts = N > 1): the host
  Buffer's segment (N*S rows of up to K entries per rank, E/N experts over R/N ranks: the worst case of
  every rail peer's tokens visiting this host), and the routed experts' saved rows N times the one-level ones.
- activations: what a pass keeps for backward (moontrain.planning.activations: per layer, and with the layers
  train.activation_checkpointing recomputes). The head and the loss (moontrain.model.lm_loss, never [S, V]
  logits): the saved grad of the head's weight (V x D), the fp32 weight-grad accumulator and one chunk's logits
  (compute dtype, fp32 and one fp32 temporary) while the loss's forward runs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from moonep import BufferConfig, Layout, glu_projections
from moontrain.config.run_config import RunConfig
from moontrain.model.lm_loss import TRITON_LOGITS_BYTES_PER_CHUNK, chunk_tokens
from moontrain.model.params import ParamCounts
from moontrain.parallel.plain_dense import SCRATCH_BYTES
from moontrain.planning.activations import activation_bytes, configured_recompute, recompute_order

ROWS = ("weights", "master", "grads", "optimizer", "symmetric_heap", "receive_buffers", "activations")


@dataclass(kw_only=True, slots=True)
class MemoryEstimate:
    dense: dict[str, float]  # bytes per row of ROWS
    experts: dict[str, float]
    heap: dict[str, int]  # bytes per symmetric-heap region (moonep.Layout.heap_bytes; empty for other backends)

    def row(self, name: str) -> float:
        return self.dense.get(name, 0.0) + self.experts.get(name, 0.0)

    @property
    def total(self) -> float:
        return sum(self.row(name) for name in ROWS)

    @property
    def allocator(self) -> float:
        """The part of the total the PyTorch allocator holds (all but the symmetric heap)."""
        return self.total - sum(self.heap.values())


def estimate_memory(cfg: RunConfig, counts: ParamCounts, world_size: int, compute_bytes: int,
                    recomputed: Collection[int] | None = None) -> MemoryEstimate:
    """recomputed: the layers activation checkpointing recomputes; None: those train.activation_checkpointing
    names, none for "auto" before it is resolved (fit_recompute)."""
    m, R = cfg.model, cfg.parallel.ep
    if recomputed is None:
        recomputed = configured_recompute(cfg, compute_bytes) or ()
    epn = m.num_experts // R
    H, F, K = m.expert_width, m.moe_intermediate_size, m.num_experts_per_tok
    S = cfg.train.micro_batch(world_size) * cfg.train.seq_len  # tokens per rank per forward/backward
    local = m.num_moe_layers * epn * 3 * H * F
    P = counts.dense
    gathered = counts.embedding + 2 * counts.max_block_dense(m)
    dense_grads = 4 * P / world_size + 2 * counts.max_block_dense(m) * compute_bytes
    dense_shards = world_size  # the ranks the fp32 dense masters and their Adam state are split over
    dense_mode = cfg.parallel.dense_at(world_size)
    pass_grads = 0  # compute-dtype grads that live only from a pass's backward to its accumulation
    if dense_mode == "plain":  # world 1: every dense weight's copy, fp32 accumulators (+ scratch)
        gathered = P
        dense_grads = 4 * P + _plain_scratch_bytes(cfg, world_size, compute_bytes)
        pass_grads = P * compute_bytes
    elif dense_mode == "allreduce":  # the fp32 parameters whole on every rank, run as they are
        gathered, dense_grads, dense_shards = 0, 4 * P, 1
    moonep = cfg.experts.backend == "moonep"
    moments = 2 * (2 if cfg.optim.state_dtype == "bfloat16" else 4)  # Adam's two moments (optim.state_dtype)
    dense = {
        "weights": gathered * compute_bytes,
        "master": 4 * P / dense_shards,
        "grads": dense_grads,
        "optimizer": moments * P / dense_shards,
        "activations": activation_bytes(cfg, compute_bytes, recomputed, S, _head_loss_bytes(cfg, compute_bytes, S),
                                        backward=pass_grads),
    }
    shards = world_size // R if cfg.parallel.shard_expert_state else 1  # the replicas the expert state splits over
    experts = {
        "weights": local * compute_bytes,
        "master": 4 * local / shards,
        "grads": 4 * local,
        "optimizer": moments * local / shards,
        "symmetric_heap": 0.0,
        "receive_buffers": S * K * H * compute_bytes,
    }
    heap: dict[str, int] = {}
    if moonep:  # the sizes moonep's Buffer and ExpertPools allocate, from its Layout
        dtype = {2: torch.bfloat16, 4: torch.float32}[compute_bytes]
        N = cfg.parallel.ep_hosts  # hierarchical EP: the host Buffer of moonep.HierarchicalBuffer
        layout = Layout(BufferConfig(max_tokens=N * S, hidden=H, topk=K, num_experts=m.num_experts // N,
                                     token_padding=cfg.experts.token_padding, dtype=dtype, entries=N > 1,
                                     options=cfg.experts.moonep), R // N)
        heap = layout.heap_bytes(glu_projections(H, F), m.num_moe_layers)
        experts["weights"], experts["grads"] = heap["weights"], heap["grads"]
        experts["symmetric_heap"] = heap["slot_pool"] + heap["reduce_pool"]
        experts["receive_buffers"] = heap["comm"]
    return MemoryEstimate(dense=dense, experts=experts, heap=heap)


def _plain_scratch_bytes(cfg: RunConfig, world_size: int, compute_bytes: int) -> int:
    """parallel.dense=plain's fp32 scratch, from a step's second pass on: the foreach adds widen each group of
    grads into one bounded buffer (the largest dense tensor, at least SCRATCH_BYTES); the Triton accumulator
    (parallel.plain_accumulate triton, or auto on a GPU: a bf16 run here) adds in place and needs none."""
    choice = cfg.parallel.plain_accumulate
    triton = choice == "triton" or (choice == "auto" and compute_bytes == 2)
    if cfg.train.accumulation_steps(world_size) == 1 or triton:
        return 0
    return max(4 * cfg.model.vocab_size * cfg.model.hidden_size, SCRATCH_BYTES)


def _head_loss_bytes(cfg: RunConfig, c: int, S: int) -> float:
    """The head and the loss beyond the per-token grad: the saved weight grad (compute dtype), the fp32
    accumulator, and a chunk of at most S tokens' logits: in the compute dtype and twice in fp32 for the PyTorch
    chunk math, in the compute dtype alone for the Triton one (its larger chunk); the larger of the two."""
    V, D = cfg.model.vocab_size, cfg.model.hidden_size
    torch_chunk = min(S, chunk_tokens(V)) * V * (c + 8)
    triton_chunk = min(S, chunk_tokens(V, TRITON_LOGITS_BYTES_PER_CHUNK)) * V * c
    return V * D * (c + 4) + max(torch_chunk, triton_chunk)


# train.activation_checkpointing=auto fits the estimate into this share of the GPU's memory, leaving the rest to
# what the estimate does not count: the CUDA context, the libraries' workspaces and the allocator's fragmentation
# (k3_small's recipe batch on an H200: 75.1 GiB allocated at the peak, 78.3 GiB reserved, beside the 15.3 GiB
# symmetric heap; the estimate, 90.6 GiB, sits at the allocated sum; on an H100 with 7 layers recomputed, 58.4
# GiB allocated, 59.8 reserved)
AUTO_SHARE = 0.95


def planned_recompute(cfg: RunConfig, counts: ParamCounts, world_size: int, compute_bytes: int,
                      gpu_bytes: float | None) -> tuple[int, ...]:
    """The layers a run recomputes: those train.activation_checkpointing names, "auto" resolved against a GPU of
    gpu_bytes (AUTO_SHARE of it; None, a CPU run: none)."""
    layers = configured_recompute(cfg, compute_bytes)
    if layers is not None:
        return layers
    return () if gpu_bytes is None else fit_recompute(cfg, counts, world_size, compute_bytes, AUTO_SHARE * gpu_bytes)


def fit_recompute(cfg: RunConfig, counts: ParamCounts, world_size: int, compute_bytes: int,
                  have: float) -> tuple[int, ...]:
    """The fewest layers of activations.recompute_order whose estimate fits `have` bytes (ascending); every layer
    when none fits (the launch then warns)."""
    order = recompute_order(cfg, compute_bytes)
    for n in range(len(order) + 1):
        layers = tuple(sorted(order[:n]))
        if estimate_memory(cfg, counts, world_size, compute_bytes, layers).total <= have:
            return layers
    return tuple(range(len(order)))
