"""Expert-grouped row layout and the grouped gated-FFN GEMMs shared by the local and all-to-all backends.

Legend: n routed entries (token, k) on this rank, G expert groups, Hin/F widths, R padded rows.

Entries are laid out expert by expert (stable: original order inside an expert); each group is padded
to `padding` rows with zeros, and `offs_G` holds the cumulative padded ends (torch._grouped_mm's offs).
torch._grouped_mm runs on CPU (fp32/bf16) and on sm90+ GPUs (bf16); its rows past offs[-1] are
undefined, so the layout is exact (R = offs[-1]), which costs one host read of the group sizes, as
every dynamic-shape EP path does (moonep's static-shape path avoids it).
"""

from __future__ import annotations

import torch

from moontrain.model.config import FFNActivation
from moontrain.model.ffn import glu_activation


def group_rows(expert_idx_n: torch.Tensor, num_groups: int, padding: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Returns (row_n: destination row of each entry, offs_G int32, total padded rows)."""
    counts_G = torch.bincount(expert_idx_n, minlength=num_groups)
    padded_G = (counts_G + padding - 1) // padding * padding
    ends_G = torch.cumsum(padded_G, 0)
    order_n = torch.argsort(expert_idx_n, stable=True)
    sorted_expert_n = expert_idx_n[order_n]
    first_sorted_G = torch.cumsum(counts_G, 0) - counts_G
    rank_in_group_n = torch.arange(expert_idx_n.numel(), device=expert_idx_n.device) - first_sorted_G[sorted_expert_n]
    row_n = torch.empty_like(expert_idx_n)
    row_n[order_n] = (ends_G - padded_G)[sorted_expert_n] + rank_in_group_n
    num_rows = int(ends_G[-1]) if num_groups else 0
    return row_n, ends_G.to(torch.int32), num_rows


def scatter_rows(x_nH: torch.Tensor, row_n: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x_nH[i] -> row row_n[i] of a zero-padded [num_rows, H] tensor (differentiable)."""
    return x_nH.new_zeros(num_rows, x_nH.shape[1]).index_copy(0, row_n, x_nH)


def grouped_mm(x_RH: torch.Tensor, w_GHF: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    y = torch._grouped_mm(x_RH, w_GHF, offs=offs_G)
    if y.requires_grad:
        # the grouped-GEMM backward rejects stride-0 (expanded) grads such as those of .sum()
        y.register_hook(lambda g: g.contiguous())
    return y


def grouped_glu(x_RH: torch.Tensor, offs_G: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                activation: FFNActivation) -> torch.Tensor:
    """Per expert group: act(x W_gate, x W_up) W_down, x W_gate and x W_up from one GEMM against w_gate_up
    [G, H, 2F] = [W_gate | W_up] (ExpertWeights). The activation takes the column halves as strided views
    (no copy; moonep's situ_glu kernel on bf16 CUDA makes them contiguous); split's backward concatenates their
    grads into the one [R, 2F] grad that the input- and weight-gradient GEMMs read."""
    h_RF, u_RF = grouped_mm(x_RH, w_gate_up, offs_G).split(w_gate_up.shape[-1] // 2, dim=1)
    return grouped_mm(glu_activation(activation, h_RF, u_RF), w_down, offs_G)


def combine_topk(y_nH: torch.Tensor, weights_sK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each token's K expert outputs, accumulated in fp32."""
    s, K = weights_sK.shape
    y_sKH = y_nH.float().view(s, K, -1) * weights_sK.float().unsqueeze(-1)
    return y_sKH.sum(1).to(out_dtype)
