"""Sigmoid router with a score-correction bias (aux-loss-free balancing) and an optional sequence aux loss.

Legend: B batch, T sequence, s = B*T tokens, D hidden, E routed experts, K top-k.

Selection uses sigmoid(logits) + bias; the combine weights use the unbiased scores, renormalised over
the chosen K and multiplied by routed_scaling_factor (DeepSeek-V3 / Kimi K2). With group-limited routing
(model.num_expert_groups > 1) a token chooses only among the experts of its topk_expert_groups best groups. The bias is not trained
by gradients: after every optimizer step it moves by `update_rate * sign(mean_count - count_e)`
(model.router_bias_update = "proportional": `update_rate * (mean_count - count_e) / mean_count`) using token counts reduced over the whole world, so every rank keeps the same bias. With
model.router_mean_free_updates the optimizer step leaves each router's weights along the step's mean
input unchanged, so expert popularity is the bias's alone (moontrain.model.router_updates).
Routing math runs in fp32 whatever the compute dtype: near-ties in bf16 would flip top-k choices.
On CUDA with bf16 activations and kernels.router_gemm=split_bf16 the logits GEMM and its backward run on
bf16 tensor cores (RouterLogits): each fp32 operand is split into two bf16 terms (hi + lo, within 2^-16 of
it), the bf16 activations are exact, the products are exact in the fp32 accumulator. No fp32 copy of the
[s, D] input or of its gradient is made (the copies and the precision: docs/performance.md).

Forced skew (benchmarks call set_skew(sigma), sigma > 0; no recipe key): a fixed expert popularity
p_e = exp(sigma * z_e), z ~ N(0, 1) from SKEW_SEED on the CPU (so every rank and every layer gets the
same z), enters the selection as log p_e = sigma * z_e added to the biased scores; the combine weights
stay unbiased. The realised expert maxvio rises with sigma (benchmarks/bench_train.py bisects sigma to a
target maxvio). sigma = 0 skips the addition, so routing is bitwise what it is without the knob.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from moontrain.model.bf16_mm import mm
from moontrain.model.config import ModelConfig

SKEW_SEED = 9


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32) as hi + lo in bf16: hi = bf16(x), lo = bf16(x - hi) (x - hi is exact in fp32), so
    |x - hi - lo| <= 2^-16 |x|."""
    hi = x.bfloat16()
    return hi, (x - hi.float()).bfloat16()


class RouterLogits(torch.autograd.Function):
    """logits_sE = x_sD @ w_ED^T in fp32 on bf16 tensor cores, for bf16 x_sD and fp32 w_ED (kernels.router_gemm=
    split_bf16). w = w_hi + w_lo (split_bf16): the forward is one GEMM of x against the [2E, D] stack of both
    halves with fp32 output, summed over the halves. Backward, with the fp32 logit grads g = g_hi + g_lo:
    grad_x = g_hi w_hi + g_hi w_lo + g_lo w_hi as one GEMM of K = 3E rounded once to bf16 (the dropped g_lo w_lo
    is 2^-16 of |g||w|), grad_w = g_hi^T x + g_lo^T x as one GEMM with fp32 output. A custom function: autograd's
    own would keep and make fp32 copies of x; x is saved as it is (bf16)."""

    @staticmethod
    def forward(ctx, x_sD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        E = w_ED.shape[0]
        w_hi, w_lo = split_bf16(w_ED.float())
        ctx.save_for_backward(x_sD, w_hi, w_lo)
        out_s2E = mm(x_sD, torch.cat([w_hi, w_lo]).t(), torch.float32)
        return out_s2E[:, :E] + out_s2E[:, E:]

    @staticmethod
    def backward(ctx, grad_sE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_sD, w_hi, w_lo = ctx.saved_tensors
        E = w_hi.shape[0]
        g_hi, g_lo = split_bf16(grad_sE.float())
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = mm(torch.cat([g_hi, g_hi, g_lo], 1), torch.cat([w_hi, w_lo, w_hi]), x_sD.dtype)
        if ctx.needs_input_grad[1]:
            out_2ED = mm(torch.cat([g_hi, g_lo], 1).t(), x_sD, torch.float32)
            grad_w = out_2ED[:E] + out_2ED[E:]
        return grad_x, grad_w


def skew_bias_E(num_experts: int, sigma: float) -> torch.Tensor:
    """log p_e = sigma * z_e (fp32, CPU): the selection bias of a log-normal popularity with spread sigma."""
    z_E = torch.randn(num_experts, generator=torch.Generator().manual_seed(SKEW_SEED),
                      dtype=torch.float64, device="cpu")
    return (sigma * z_E).float()


class Router(nn.Module):
    """gemm: kernels.router_gemm (split_bf16: the logits GEMMs on bf16 tensor cores for bf16 inputs on CUDA;
    fp32: IEEE fp32 GEMMs). kernel: kernels.router (auto, triton: moontrain.model.router_kernel's kernels on CUDA,
    where they apply: bf16 activations and weights, split_bf16, no expert groups and no sequence aux loss; the
    PyTorch math below otherwise)."""

    def __init__(self, cfg: ModelConfig, *, gemm: str = "split_bf16", kernel: str = "auto",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        from moontrain.model.kernel_choice import runs_cuda_kernels

        self.kernel = runs_cuda_kernels("router", kernel, device, "the PyTorch math")
        self.kernel_forced = kernel == "triton"
        if self.kernel:
            from moontrain.model.router_kernel import unsupported

            why = unsupported(cfg.num_experts, cfg.num_experts_per_tok, gemm=gemm, groups=cfg.num_expert_groups,
                              seq_aux_loss_coef=cfg.seq_aux_loss_coef)
            if why is not None and self.kernel_forced:
                raise ValueError(f"kernels.router=triton: {why}; kernels.router=auto runs the PyTorch math there")
            self.kernel = why is None
        self.num_experts = cfg.num_experts
        self.topk = cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.update_rate = cfg.router_bias_update_rate
        self.proportional_update = cfg.router_bias_update == "proportional"
        self.seq_aux_loss_coef = cfg.seq_aux_loss_coef
        self.split_bf16 = gemm == "split_bf16"
        self.num_groups, self.topk_groups = cfg.num_expert_groups, cfg.topk_expert_groups
        self._counting = True  # off inside not_counting()
        self.mean_free_updates = cfg.router_mean_free_updates
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device))
        self.register_buffer("score_bias_E", torch.zeros(cfg.num_experts, device=device))
        # the forced skew (set_skew; 0: none), never trained or checkpointed
        self.skew = 0.0
        self.register_buffer("skew_bias_E", torch.zeros(cfg.num_experts, device=device), persistent=False)
        # tokens routed to each expert since the last bias update (this rank only; reduced by the trainer).
        # int64: a world-reduced count passes 2^24 (fp32's exact range) at K3 scale
        self.register_buffer("tokens_per_expert_E", torch.zeros(cfg.num_experts, dtype=torch.long, device=device),
                             persistent=False)

        # sum of the router inputs since the last optimizer step (this rank only; fp32), for the mean-free
        # updates of moontrain.model.router_updates
        self.register_buffer("input_sum_D", torch.zeros(cfg.hidden_size, device=device), persistent=False)

    def forward(self, x_sD: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns (weights_sK fp32, topk_sK int64, sequence aux loss or None)."""
        if self._counting and self.mean_free_updates:  # the step's mean input direction (router_updates)
            self.input_sum_D += x_sD.detach().sum(0, dtype=torch.float32)
        if self.kernel and x_sD.dtype == self.weight.dtype == torch.bfloat16:
            from moontrain.model.router_kernel import routed_scores

            weights_sK, topk_sK = routed_scores(x_sD, self.weight, self.score_bias_E,
                                                self.skew_bias_E if self.skew else None,
                                                self.tokens_per_expert_E if self._counting else None,
                                                self.topk, self.scaling)
            return weights_sK, topk_sK, None
        if self.kernel and self.kernel_forced:
            raise ValueError(f"kernels.router=triton needs bf16 activations and router weights, got {x_sD.dtype} and "
                             f"{self.weight.dtype}; kernels.router=auto runs the PyTorch math for them")
        if self.split_bf16 and x_sD.is_cuda and x_sD.dtype == torch.bfloat16:
            logits_sE = RouterLogits.apply(x_sD, self.weight.float())
        else:
            logits_sE = F.linear(x_sD.float(), self.weight.float())
        scores_sE = torch.sigmoid(logits_sE)
        select_sE = scores_sE.detach() + self.score_bias_E
        if self.skew:
            select_sE = select_sE + self.skew_bias_E
        if self.num_groups > 1:
            select_sE = self._limit_to_groups(select_sE)
        topk_sK = torch.topk(select_sE, self.topk, dim=-1).indices
        weights_sK = scores_sE.gather(1, topk_sK)
        weights_sK = weights_sK / weights_sK.sum(-1, keepdim=True) * self.scaling
        if self._counting:
            # index_add_, not bincount: CUDA bincount reads the max id on the host (a sync per layer)
            flat = topk_sK.flatten()
            self.tokens_per_expert_E.index_add_(0, flat, torch.ones_like(flat))
        aux = None
        if self.seq_aux_loss_coef > 0:
            aux = self._sequence_aux_loss(scores_sE, topk_sK, batch)
        return weights_sK, topk_sK, aux

    def _limit_to_groups(self, select_sE: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: experts outside the token's topk_groups best groups (a group scores the
        sum of its two best selection scores) get -inf."""
        s, G = select_sE.shape[0], self.num_groups
        select_sGe = select_sE.view(s, G, -1)
        group_sG = select_sGe.topk(2, dim=-1).values.sum(-1)
        keep_sG = torch.zeros_like(group_sG, dtype=torch.bool)
        keep_sG.scatter_(1, group_sG.topk(self.topk_groups, dim=-1).indices, True)
        return select_sGe.masked_fill(~keep_sG.unsqueeze(-1), float("-inf")).view(s, -1)

    def _sequence_aux_loss(self, scores_sE: torch.Tensor, topk_sK: torch.Tensor, batch: int) -> torch.Tensor:
        """DeepSeek-V3 eq. 17-20: alpha * sum_e f_e P_e per sequence, averaged over sequences."""
        E, K = self.num_experts, self.topk
        probs_BTE = (scores_sE / scores_sE.sum(-1, keepdim=True)).view(batch, -1, E)
        T = probs_BTE.shape[1]
        chosen_BTE = torch.zeros_like(probs_BTE).scatter_(2, topk_sK.view(batch, T, K), 1.0)
        f_BE = chosen_BTE.sum(1) * (E / (K * T))
        p_BE = probs_BTE.mean(1)
        return self.seq_aux_loss_coef * (f_BE * p_BE).sum(-1).mean()

    @contextmanager
    def not_counting(self) -> Iterator[None]:
        """Forwards inside leave the balancing statistics (token counts, input sums) alone: a recompute under
        activation checkpointing, an evaluation."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    @torch.no_grad()
    def set_skew(self, sigma: float) -> None:
        """Force a routing skew of spread `sigma` (benchmarks; 0: none), in place."""
        if sigma < 0:
            raise ValueError(f"router skew must be >= 0 (0: no skew), got {sigma}")
        self.skew = sigma
        self.skew_bias_E.copy_(skew_bias_E(self.num_experts, sigma))

    @torch.no_grad()
    def reset_step_statistics(self) -> None:
        """Forget the token counts and input sums gathered since the last optimizer step."""
        self.tokens_per_expert_E.zero_()
        self.input_sum_D.zero_()

    @torch.no_grad()
    def update_bias(self, global_tokens_per_expert_E: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """The aux-loss-free bias step from the world's counts; gate: a 0/1 device scalar that multiplies
        the step (0: a skipped training step, decided on the device, leaves the bias as it was)."""
        counts = global_tokens_per_expert_E.double()
        if self.proportional_update:
            mean = counts.mean().clamp_min(1.0)
            delta = (self.update_rate * (mean - counts) / mean).to(self.score_bias_E.dtype)
        else:
            delta = self.update_rate * torch.sign(counts.mean() - counts)
        if gate is not None:
            delta = delta * gate.to(delta.dtype)
        self.score_bias_E += delta
        self.tokens_per_expert_E.zero_()
