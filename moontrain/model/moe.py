"""The MoE layer: sigmoid router, optional latent projection, routed experts via a backend, shared experts.

Legend: B batch, T sequence, s = B*T tokens, D hidden, L latent width (expert width H), K top-k.

Latent MoE (K3): routed experts run at width L: x_sL = RMSNorm(x_sD W_down); y_sD = experts(x_sL) W_up, that
GEMM adding into the shared experts' output in place (addmm_: beta = 1 reads it in the epilogue; an out-of-place
addmm would first copy it, an add read it twice): one launch and ~2 passes over [s, D] fewer.
Shared experts see the full width D and are one gated FFN of width num_shared * F (identical to the sum
of num_shared separate experts). They run on the caller's stream: on a side stream, overlapping the
routed experts' communication, their GEMMs held up moonep's device barriers and FSDP's all-gathers and
made the peak memory depend on the routing (2xH200, k3_small_moe, 2026-11-29; docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import nn

from moontrain.model.config import ModelConfig
from moontrain.model.experts import ExpertsBackend, ExpertWeights
from moontrain.model.ffn import GatedFFN
from moontrain.model.norm import RMSNorm
from moontrain.model.router import Router


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, *, ep_rank: int, ep: int, router_gemm: str = "split_bf16",
                 router_kernel: str = "auto", device: torch.device | str | None = None) -> None:
        super().__init__()
        self.router = Router(cfg, gemm=router_gemm, kernel=router_kernel, device=device)
        if cfg.moe_latent_size is not None:
            self.latent_down = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=False, device=device)
            self.latent_norm = RMSNorm(cfg.moe_latent_size, cfg.norm_eps, device=device)
            self.latent_up = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=False, device=device)
        self.experts = ExpertWeights(num_experts=cfg.num_experts, ep_rank=ep_rank, ep=ep,
                                     hidden=cfg.expert_width, intermediate=cfg.moe_intermediate_size,
                                     device=device)
        self.shared = (GatedFFN(cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                cfg.ffn_activation, device=device) if cfg.num_shared_experts else None)
        self.latent = cfg.moe_latent_size is not None
        self.backend: ExpertsBackend | None = None  # attached after construction (may be collective)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.backend is not None, "attach an experts backend before the forward pass"
        B, T, D = x_BTD.shape
        x_sD = x_BTD.reshape(B * T, D)
        weights_sK, topk_sK, aux = self.router(x_sD, B)
        h_sH = self.latent_norm(self.latent_down(x_sD)) if self.latent else x_sD
        y_sH = self.backend.forward(h_sH, weights_sK, topk_sK)
        shared_sD = self.shared(x_sD) if self.shared is not None else None
        if self.latent and shared_sD is not None:  # the up projection's GEMM adds into the shared experts' output
            y_sD = shared_sD.addmm_(y_sH, self.latent_up.weight.t())
        elif self.latent:
            y_sD = self.latent_up(y_sH)
        else:
            y_sD = y_sH if shared_sD is None else y_sH + shared_sD
        return y_sD.view(B, T, D), aux
