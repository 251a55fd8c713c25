"""The experts-backend interface: what a backend computes, what one model's backends share at run time,
and the context they are built from.

Legend: s tokens on this rank, H expert width, K top-k.

A backend maps (x_sH, weights_sK, topk_sK) -> y_sH = sum_k weights[t,k] * expert_{topk[t,k]}(x[t]),
with autograd to x and weights, and weight gradients landing in ExpertWeights.grad (fp32, local rows).
An ExpertsRuntime builds the backend of each MoE layer of one model and owns what they share (moonep's
Buffer and ExpertPools); runtimes are built by name in registry.py (adding one is one entry there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from moonep import BufferOptions
from moontrain.model.config import FFNActivation

if TYPE_CHECKING:
    from moontrain.model.experts.weights import ExpertWeights


class ExpertsBackend(Protocol):
    def forward(self, x_sH: torch.Tensor, weights_sK: torch.Tensor, topk_sK: torch.Tensor) -> torch.Tensor: ...


class ExpertsRuntime(Protocol):
    def layer(self, weights: ExpertWeights) -> ExpertsBackend:
        """The backend of one MoE layer (collective for moonep: its first layer allocates the buffer)."""
        ...

    def finish_backward(self) -> None:
        """Make the current stream wait for work the backends left queued after backward (moonep's
        reduce_grad on its communication stream) before the expert grads are read; no host sync."""
        ...

    def close(self) -> None:
        """Release what the backends own (moonep's symmetric heap); expert tensors become invalid."""
        ...


@dataclass(kw_only=True)
class ExpertsContext:
    """What every backend of a model is built from: the EP group and sizes, the step's constants."""

    num_experts: int
    topk: int
    ep_group: dist.ProcessGroup | None
    ep: int  # the EP degree: ranks in ep_group (parallel.ep)
    compute_dtype: torch.dtype
    token_padding: int
    max_tokens: int  # tokens per rank per call (S)
    device: torch.device
    # The one owner of the loss scale: the factor the training loss puts on every expert-weight grad,
    # applied as the grads accumulate (1 / world size: each rank's loss is the mean over its own tokens;
    # see Trainer). Backends fold it in; nothing rescales the grads afterwards.
    loss_scale: float = 1.0
    activation: FFNActivation = "swiglu"  # the experts' gated activation (ModelConfig.ffn_activation)
    # blocks run their forward again in backward (activation checkpointing): a backend must not carry
    # state from one layer's forward to the next one's (moonep's chained prefetch)
    recomputed_in_backward: bool = False
    moonep: BufferOptions = field(default_factory=BufferOptions)  # how the moonep backend's Buffer runs
    # hierarchical EP (parallel.ep_hosts > 1, moonep only): this host's ranks of the EP group and the rail
    # group (one rank per host); None: one level
    ep_host_group: dist.ProcessGroup | None = None
    ep_rail_group: dist.ProcessGroup | None = None
