"""Sigmoid router with a score-correction bias (aux-loss-free balancing) and an optional sequence aux loss.

Legend: B batch, T sequence, s = B*T tokens, D hidden, E routed experts, K top-k.

Selection uses sigmoid(logits) + bias; the combine weights use the unbiased scores, renormalised over
the chosen K and multiplied by routed_scaling_factor (DeepSeek-V3 / Kimi K2). The bias is not trained
by gradients: after every optimizer step it moves by `update_rate * sign(mean_count - count_e)`
using token counts reduced over the whole world, so every rank keeps the same bias.
Routing math runs in fp32 whatever the compute dtype: near-ties in bf16 would flip top-k choices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moontrain.model.config import ModelConfig


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.topk = cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.update_rate = cfg.router_bias_update_rate
        self.seq_aux_loss_coef = cfg.seq_aux_loss_coef
        self.count_tokens = True  # off while activation checkpointing recomputes this layer
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device))
        self.register_buffer("score_bias_E", torch.zeros(cfg.num_experts, device=device))
        # tokens routed to each expert since the last bias update (this rank only; reduced by the trainer).
        # int64: a world-reduced count passes 2^24 (fp32's exact range) at K3 scale
        self.register_buffer("tokens_per_expert_E", torch.zeros(cfg.num_experts, dtype=torch.long, device=device),
                             persistent=False)

    def forward(self, x_sD: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns (weights_sK fp32, topk_sK int64, sequence aux loss or None)."""
        logits_sE = F.linear(x_sD.float(), self.weight.float())
        scores_sE = torch.sigmoid(logits_sE)
        topk_sK = torch.topk(scores_sE.detach() + self.score_bias_E, self.topk, dim=-1).indices
        weights_sK = scores_sE.gather(1, topk_sK)
        weights_sK = weights_sK / weights_sK.sum(-1, keepdim=True) * self.scaling
        if self.count_tokens:
            self.tokens_per_expert_E += torch.bincount(topk_sK.flatten(), minlength=self.num_experts)
        aux = None
        if self.seq_aux_loss_coef > 0:
            aux = self._sequence_aux_loss(scores_sE, topk_sK, batch)
        return weights_sK, topk_sK, aux

    def _sequence_aux_loss(self, scores_sE: torch.Tensor, topk_sK: torch.Tensor, batch: int) -> torch.Tensor:
        """DeepSeek-V3 eq. 17-20: alpha * sum_e f_e P_e per sequence, averaged over sequences."""
        E, K = self.num_experts, self.topk
        probs_BTE = (scores_sE / scores_sE.sum(-1, keepdim=True)).view(batch, -1, E)
        T = probs_BTE.shape[1]
        chosen_BTE = torch.zeros_like(probs_BTE).scatter_(2, topk_sK.view(batch, T, K), 1.0)
        f_BE = chosen_BTE.sum(1) * (E / (K * T))
        p_BE = probs_BTE.mean(1)
        return self.seq_aux_loss_coef * (f_BE * p_BE).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, global_tokens_per_expert_E: torch.Tensor) -> None:
        counts = global_tokens_per_expert_E.double()
        self.score_bias_E += self.update_rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert_E.zero_()
