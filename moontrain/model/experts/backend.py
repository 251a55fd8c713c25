"""The experts-backend interface and the registry that builds one per MoE layer by name.

Legend: s tokens on this rank, H expert width, K top-k.

A backend maps (x_sH, weights_sK, topk_sK) -> y_sH = sum_k weights[t,k] * expert_{topk[t,k]}(x[t]),
with autograd to x and weights, and weight gradients landing in ExpertWeights.grad (fp32, local rows).
Adding a backend is one entry in BACKENDS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moonep import BufferOptions
from moontrain.model.config import FFNActivation
from moontrain.model.experts.weights import ExpertWeights


class ExpertsBackend(Protocol):
    def forward(self, x_sH: torch.Tensor, weights_sK: torch.Tensor, topk_sK: torch.Tensor) -> torch.Tensor: ...


@dataclass(kw_only=True)
class ExpertsContext:
    """What every backend of a model shares: the EP group and sizes, plus backend-owned state."""

    num_experts: int
    topk: int
    ep_group: dist.ProcessGroup | None
    ep_size: int
    compute_dtype: torch.dtype
    token_padding: int
    max_tokens: int  # tokens per rank per call (S)
    device: torch.device
    moonep_options: BufferOptions = field(default_factory=BufferOptions)  # the moonep backend's Buffer
    activation: FFNActivation = "swiglu"  # the experts' gated activation (ModelConfig.ffn_activation)
    # ExpertPools.chain_prefetch: off when blocks are recomputed in backward (activation checkpointing)
    moonep_chain_prefetch: bool = True
    shared: dict[str, Any] = field(default_factory=dict)  # e.g. moonep's Buffer and ExpertPools
    closers: list[Callable[[], None]] = field(default_factory=list)  # release backend-owned memory
    # order work the backends left queued after backward (moonep's reduce_grad on its communication
    # stream) before the caller's stream reads the expert grads
    finishers: list[Callable[[], None]] = field(default_factory=list)

    def finish_backward(self) -> None:
        """Make the current stream wait for the backends' outstanding backward work (no host sync)."""
        for finish in self.finishers:
            finish()

    def close(self) -> None:
        """Release what the backends own (moonep's symmetric heap); expert tensors become invalid."""
        while self.closers:
            self.closers.pop()()


def _build_local(ctx: ExpertsContext, weights: ExpertWeights) -> ExpertsBackend:
    from moontrain.model.experts.local import LocalExperts

    return LocalExperts(ctx, weights)


def _build_alltoall(ctx: ExpertsContext, weights: ExpertWeights) -> ExpertsBackend:
    from moontrain.model.experts.alltoall import AllToAllExperts

    return AllToAllExperts(ctx, weights)


def _build_moonep(ctx: ExpertsContext, weights: ExpertWeights) -> ExpertsBackend:
    from moontrain.model.experts.moonep_backend import MoonEPExperts

    return MoonEPExperts(ctx, weights)


BACKENDS: dict[str, Callable[[ExpertsContext, ExpertWeights], ExpertsBackend]] = {
    "local": _build_local,
    "alltoall": _build_alltoall,
    "moonep": _build_moonep,
}


def build_experts_backend(name: str, ctx: ExpertsContext, weights: ExpertWeights) -> ExpertsBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown experts backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name](ctx, weights)
