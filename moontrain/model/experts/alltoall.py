"""All-to-all expert parallelism (the dispatcher torchtitan uses), for comparison and as a fallback.

Legend: s tokens, K top-k, n = s*K entries, R EP ranks, epn = E/R local experts, m received rows.

Forward: histogram the entries per expert; exchange the per-expert counts (all_to_all_single of [R*epn]
ints); read the split sizes on the host (one sync per layer: the shapes are dynamic); send each
entry's token row to its expert's rank (entries sorted by expert are already grouped by destination);
permute the received rows from (source, expert) order into padded expert groups; grouped gated-FFN GEMMs;
reverse the permutation and the all-to-all; weight and sum the K outputs per token in fp32.
Backward is autograd through the same path, with the all-to-all transposed (splits swapped).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moontrain.model.experts.backend import ExpertsContext
from moontrain.model.experts.grouped import combine_topk, group_rows, grouped_glu, scatter_rows
from moontrain.model.experts.weights import ExpertWeights


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nH: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_nH.new_empty(sum(out_splits), x_nH.shape[1])
        dist.all_to_all_single(out, x_nH.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(in_splits), grad_out.shape[1])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


class AllToAllExperts:
    def __init__(self, ctx: ExpertsContext, weights: ExpertWeights) -> None:
        if ctx.ep > 1 and ctx.ep_group is None:
            raise ValueError(f"the alltoall backend needs a process group for ep={ctx.ep}")
        self.ctx = ctx
        self.weights = weights
        weights.bind_owned(ctx.compute_dtype, ctx.loss_scale)

    def forward(self, x_sH: torch.Tensor, weights_sK: torch.Tensor, topk_sK: torch.Tensor) -> torch.Tensor:
        ctx, R = self.ctx, self.ctx.ep
        epn = ctx.num_experts // R
        K = topk_sK.shape[1]
        expert_n = topk_sK.reshape(-1)
        counts_E = torch.bincount(expert_n, minlength=ctx.num_experts)
        order_n = torch.argsort(expert_n, stable=True)
        x_nH = x_sH.to(ctx.compute_dtype)[order_n // K]
        if R > 1:
            recv_counts_E = torch.empty_like(counts_E)
            dist.all_to_all_single(recv_counts_E, counts_E, group=ctx.ep_group)
            send_splits = counts_E.view(R, epn).sum(1).tolist()
            recv_splits = recv_counts_E.view(R, epn).sum(1).tolist()
            x_mH = _AllToAll.apply(x_nH, recv_splits, send_splits, ctx.ep_group)
        else:
            recv_counts_E, x_mH = counts_E, x_nH
        local_m = torch.repeat_interleave(torch.arange(epn, device=x_sH.device).repeat(R), recv_counts_E)
        row_m, offs_G, num_rows = group_rows(local_m, epn, ctx.token_padding)
        w = self.weights.compute
        y_RH = grouped_glu(scatter_rows(x_mH, row_m, num_rows), offs_G, w["gate_up"], w["down"], self.ctx.activation)
        y_mH = y_RH[row_m]
        y_sorted_nH = _AllToAll.apply(y_mH, send_splits, recv_splits, ctx.ep_group) if R > 1 else y_mH
        y_nH = torch.empty_like(y_sorted_nH).index_copy(0, order_n, y_sorted_nH)
        return combine_topk(y_nH, weights_sK, x_sH.dtype)
