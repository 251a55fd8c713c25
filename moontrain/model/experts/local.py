"""All E experts on this rank: the grouped-GEMM reference every EP backend must match.

Legend: s tokens, K top-k, n = s*K routed entries, H expert width, E experts.
"""

from __future__ import annotations

import torch

from moontrain.model.experts.backend import ExpertsContext
from moontrain.model.experts.grouped import combine_topk, group_rows, grouped_glu, scatter_rows
from moontrain.model.experts.weights import ExpertWeights


class LocalExperts:
    def __init__(self, ctx: ExpertsContext, weights: ExpertWeights) -> None:
        if ctx.ep != 1:
            raise ValueError(f"the local experts backend holds all experts and needs ep=1, got ep={ctx.ep}")
        self.ctx = ctx
        self.weights = weights
        weights.bind_owned(ctx.compute_dtype, ctx.loss_scale)

    def forward(self, x_sH: torch.Tensor, weights_sK: torch.Tensor, topk_sK: torch.Tensor) -> torch.Tensor:
        K = topk_sK.shape[1]
        expert_n = topk_sK.reshape(-1)
        row_n, offs_E, num_rows = group_rows(expert_n, self.ctx.num_experts, self.ctx.token_padding)
        src_n = torch.arange(expert_n.numel(), device=x_sH.device) // K
        x_RH = scatter_rows(x_sH.to(self.ctx.compute_dtype)[src_n], row_n, num_rows)
        w = self.weights.compute
        y_RH = grouped_glu(x_RH, offs_E, w["gate_up"], w["down"], self.ctx.activation)
        return combine_topk(y_RH[row_n], weights_sK, x_sH.dtype)
