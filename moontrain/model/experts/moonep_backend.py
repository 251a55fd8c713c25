"""The moonep backend: perfectly balanced EP with static shapes (docs/moonep.md §2-§7).

Expert weights live in moonep's symmetric memory: ExpertWeights binds `layer.w_local[name]` (bf16 view
of this rank's local rows) as its compute tensors and `layer.g_local[name]` (fp32 grad mirror, local
rows only; slot-row grads are folded in by moonep's reduce_grad) as its grad tensors. One Buffer and
one ExpertPools are shared by every MoE layer of the model: MoonEPRuntime creates them on the first
layer (collectively) and owns them.

Hierarchical EP (parallel.ep_hosts > 1: ExpertsContext carries the host and rail groups): the Buffer is
the host Buffer of a moonep.HierarchicalBuffer (this host's ranks, entries mode), the pools hold the same
local experts as one-level EP rank ep_rank, and each layer runs moonep.hierarchical_expert_glu (rows cross
hosts through all-to-alls over the rail group).

num_slots=None means B = what the planner can fill: epn at EP > 1, which training requires, and no slot
or reduce pool at EP = 1 (docs/moonep.md §4.2).
"""

from __future__ import annotations

import torch

import moonep
from moonep import HierarchicalBuffer, hierarchical_expert_glu
from moontrain.model.experts.backend import ExpertsContext
from moontrain.model.experts.weights import ExpertWeights


class MoonEPRuntime:
    """The Buffer and ExpertPools of one model's moonep backends (ExpertsRuntime)."""

    def __init__(self, ctx: ExpertsContext) -> None:
        if ctx.ep_group is None:
            raise ValueError("the moonep backend needs an initialised process group (launch with torchrun)")
        self.ctx = ctx
        self.buffer: moonep.Buffer | None = None  # the host Buffer of `hier` in hierarchical EP
        self.hier: HierarchicalBuffer | None = None
        self.pools: moonep.ExpertPools | None = None

    def layer(self, weights: ExpertWeights) -> MoonEPExperts:
        ctx = self.ctx
        if self.buffer is None:
            hidden = weights.shapes["down"][1]  # down is [F, H]
            config = moonep.BufferConfig(max_tokens=ctx.max_tokens, hidden=hidden, topk=ctx.topk,
                                         num_experts=ctx.num_experts, num_slots=None, token_padding=ctx.token_padding,
                                         dtype=ctx.compute_dtype, options=ctx.moonep)
            if ctx.ep_host_group is not None:
                self.hier = HierarchicalBuffer(config, ctx.ep_host_group, ctx.ep_rail_group, device=ctx.device)
                self.buffer = self.hier.host
            else:
                self.buffer = moonep.Buffer(config, ctx.ep_group, device=ctx.device)
            self.pools = moonep.ExpertPools(self.buffer, projections=dict(weights.shapes), dtype=ctx.compute_dtype,
                                            wgrad_scale=ctx.loss_scale,  # weight grads accumulate pre-scaled
                                            chain_prefetch=not ctx.recomputed_in_backward)
        return MoonEPExperts(self.buffer, self.pools, weights, ctx.activation, self.hier)

    def finish_backward(self) -> None:
        if self.buffer is not None:
            self.buffer.wait_pending()  # expert_glu leaves reduce_grad queued
            self.pools.settle_grads()  # grads declared zero and never accumulated since

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = self.pools = self.hier = None


class MoonEPExperts:
    def __init__(self, buffer: moonep.Buffer, pools: moonep.ExpertPools, weights: ExpertWeights,
                 activation: str, hier: HierarchicalBuffer | None = None) -> None:
        self.buf, self.pools, self.hier = buffer, pools, hier
        self.layer = layer = pools.add_layer()
        weights.bind_external(layer.w_local, layer.g_local,
                              defer_zero=lambda name: pools.defer_zero_grads(layer, (name,)))
        self.weights = weights
        self.activation = activation  # moonep.activation registers every ModelConfig.ffn_activation

    def forward(self, x_sH: torch.Tensor, weights_sK: torch.Tensor, topk_sK: torch.Tensor) -> torch.Tensor:
        dtype = self.pools.dtype
        args = (self.pools, self.layer, x_sH.to(dtype).contiguous(), weights_sK.contiguous(),
                topk_sK.to(torch.int32).contiguous())
        if self.hier is not None:
            y_sH = hierarchical_expert_glu(self.hier, *args, activation=self.activation)
        else:
            y_sH = moonep.expert_glu(self.buf, *args, activation=self.activation)
        return y_sH.to(x_sH.dtype)
