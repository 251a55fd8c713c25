"""The baseline a user would pick today: torchtitan-style all-to-all token dispatch.

dispatch: per-expert counts exchanged with all_to_all_single, split sizes read on the host (the
per-layer device-to-host sync), token rows sorted by expert and sent with all_to_all_single,
received rows permuted from (source rank, expert) order into expert order.
combine: the reverse permutation, the reverse all_to_all_single, then each token's K rows
weighted and summed in fp32. The backward passes are the same exchanges with the splits swapped.

Legend: s tokens, K top-k, n = s*K entries, m received rows, R ranks, epn local experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class A2AState:
    order_n: torch.Tensor  # entry order sorted by expert
    send_splits: list[int]
    recv_splits: list[int]
    perm_m: torch.Tensor  # received row i goes to expert-ordered row perm_m[i]
    num_tokens: int
    topk: int


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.R = dist.get_world_size(group)
        self.E = num_experts
        self.epn = num_experts // self.R

    def dispatch(self, x_sH: torch.Tensor, topk_sK: torch.Tensor) -> tuple[torch.Tensor, A2AState]:
        s, K = topk_sK.shape
        expert_n = topk_sK.reshape(-1).long()
        counts_E = torch.zeros(self.E, dtype=torch.int64, device=x_sH.device).scatter_add_(
            0, expert_n, torch.ones_like(expert_n))
        recv_counts_E = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_E, counts_E, group=self.group)
        both = torch.stack([counts_E.view(self.R, self.epn).sum(1), recv_counts_E.view(self.R, self.epn).sum(1)])
        send_splits, recv_splits = both.tolist()  # the host sync every layer pays
        order_n = torch.argsort(expert_n, stable=True)
        x_nH = x_sH.index_select(0, order_n // K)
        x_mH = x_sH.new_empty(sum(recv_splits), x_sH.shape[1])
        dist.all_to_all_single(x_mH, x_nH, recv_splits, send_splits, group=self.group)
        # received order: (source rank, local expert); expert order: (local expert, source rank)
        counts_RL = recv_counts_E.view(self.R, self.epn)
        start_RL = (torch.cumsum(counts_RL.t().reshape(-1), 0) - counts_RL.t().reshape(-1)).view(self.epn, self.R).t()
        local_m = torch.repeat_interleave(torch.arange(self.R * self.epn, device=x_sH.device), counts_RL.reshape(-1),
                                          output_size=sum(recv_splits))
        first_m = torch.cumsum(counts_RL.reshape(-1), 0) - counts_RL.reshape(-1)
        perm_m = start_RL.reshape(-1)[local_m] + torch.arange(local_m.numel(), device=x_sH.device) - first_m[local_m]
        rows_mH = torch.empty_like(x_mH).index_copy_(0, perm_m, x_mH)
        return rows_mH, A2AState(order_n, send_splits, recv_splits, perm_m, s, K)

    def combine(self, st: A2AState, y_mH: torch.Tensor, weights_sK: torch.Tensor) -> torch.Tensor:
        back_mH = y_mH.index_select(0, st.perm_m)
        y_nH = y_mH.new_empty(sum(st.send_splits), y_mH.shape[1])
        dist.all_to_all_single(y_nH, back_mH, st.send_splits, st.recv_splits, group=self.group)
        entries = torch.empty_like(y_nH).index_copy_(0, st.order_n, y_nH).view(st.num_tokens, st.topk, -1)
        return (entries.float() * weights_sK[:, :, None]).sum(1).to(y_mH.dtype)

    def dispatch_backward(self, st: A2AState, grad_rows_mH: torch.Tensor) -> torch.Tensor:
        """Gradient of dispatch: rows back to their tokens, summed over k."""
        back_mH = grad_rows_mH.index_select(0, st.perm_m)
        g_nH = grad_rows_mH.new_empty(sum(st.send_splits), grad_rows_mH.shape[1])
        dist.all_to_all_single(g_nH, back_mH, st.send_splits, st.recv_splits, group=self.group)
        entries = torch.empty_like(g_nH).index_copy_(0, st.order_n, g_nH).view(st.num_tokens, st.topk, -1)
        return entries.float().sum(1).to(grad_rows_mH.dtype)

    def combine_backward(self, st: A2AState, grad_y_sH: torch.Tensor) -> torch.Tensor:
        """Gradient of combine w.r.t. the expert rows: the token grads sent to every row again."""
        g_nH = grad_y_sH.index_select(0, st.order_n // st.topk)
        g_mH = grad_y_sH.new_empty(sum(st.recv_splits), grad_y_sH.shape[1])
        dist.all_to_all_single(g_mH, g_nH, st.recv_splits, st.send_splits, group=self.group)
        return torch.empty_like(g_mH).index_copy_(0, st.perm_m, g_mH)
