"""The moonep backend: perfectly balanced EP with static shapes (see SPEC.md sections 2-7).

Expert weights live in moonep's symmetric memory: ExpertWeights binds `layer.w_local[name]` (bf16 view
of this rank's local rows) as its compute tensors and `layer.g_local[name]` (fp32 grad mirror, local
rows only; slot-row grads are folded in by moonep's reduce_grad) as its grad tensors. One Buffer and
one ExpertPools are shared by every MoE layer of the model (created on the first layer, collectively).
moonep is imported lazily so the rest of moontrain works without it.

num_slots=None means B = epn, which training requires (SPEC 5.2-5.3).
"""

from __future__ import annotations

import torch

from moontrain.model.experts.backend import ExpertsContext
from moontrain.model.experts.weights import ExpertWeights


class MoonEPExperts:
    def __init__(self, ctx: ExpertsContext, weights: ExpertWeights) -> None:
        import moonep

        if ctx.activation != "swiglu":
            raise ValueError(f"the moonep backend runs SwiGLU experts only, model.ffn_activation is {ctx.activation!r}; "
                             "use experts.backend=alltoall or local")
        if ctx.ep_group is None:
            raise ValueError("the moonep backend needs an initialised process group (launch with torchrun)")
        if "moonep_pools" not in ctx.shared:
            hidden = weights.shapes["gate"][0]
            buf = moonep.Buffer(
                moonep.BufferConfig(max_tokens=ctx.max_tokens, hidden=hidden, topk=ctx.topk,
                                    num_experts=ctx.num_experts, num_slots=None, token_padding=ctx.token_padding,
                                    dtype=ctx.compute_dtype, options=ctx.moonep_options),
                ctx.ep_group, device=ctx.device,
            )
            ctx.shared["moonep_buffer"] = buf
            ctx.closers.append(buf.destroy)
            ctx.finishers.append(buf.wait_pending)  # expert_glu leaves reduce_grad queued
            pools = moonep.ExpertPools(buf, projections=dict(weights.shapes), dtype=ctx.compute_dtype)
            pools.chain_prefetch = ctx.moonep_chain_prefetch
            ctx.shared["moonep_pools"] = pools
            ctx.finishers.append(pools.settle_grads)  # grads declared zero and never accumulated since
        self.buf = ctx.shared["moonep_buffer"]
        self.pools = ctx.shared["moonep_pools"]
        self.layer = self.pools.add_layer()
        layer, pools = self.layer, self.pools
        weights.bind_external(layer.w_local, layer.g_local,
                              defer_zero=lambda name: pools.defer_zero_grads(layer, (name,)))
        self.weights = weights
        self._expert_glu = moonep.expert_glu

    def forward(self, x_sH: torch.Tensor, weights_sK: torch.Tensor, topk_sK: torch.Tensor) -> torch.Tensor:
        dtype = self.pools.dtype
        self.pools.wgrad_scale = self.weights.accumulate_scale  # read in this layer's backward
        y_sH = self._expert_glu(self.buf, self.pools, self.layer, x_sH.to(dtype).contiguous(),
                                weights_sK.contiguous(), topk_sK.to(torch.int32).contiguous())
        return y_sH.to(x_sH.dtype)
