"""Parameter counts (total and active per token), from the model built on the meta device (no memory)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moontrain.model.config import ModelConfig
from moontrain.model.transformer import K3Model


@dataclass(kw_only=True, slots=True)
class ParamCounts:
    embedding: int  # token embedding + LM head
    attention: int  # MLA and KDA layers
    kda_attention: int  # the KDA layers' part of `attention`
    dense_ffn: int
    routed_experts: int  # all E experts of all MoE layers
    shared_experts: int
    router_and_latent: int  # routers, latent down/up projections
    norms: int
    attn_res: int  # AttnRes pseudo-queries and key-norm weights (2 per layer + the final aggregation)
    active: int  # parameters touched per token (K of E routed experts)

    @property
    def total(self) -> int:
        return (self.embedding + self.attention + self.dense_ffn + self.routed_experts + self.shared_experts
                + self.router_and_latent + self.norms + self.attn_res)

    @property
    def dense(self) -> int:
        """Everything FSDP shards (all but the routed experts)."""
        return self.total - self.routed_experts

    def max_block_dense(self, cfg: ModelConfig) -> int:
        """Dense parameters of the largest block (what FSDP gathers at once, per block)."""
        mla = (self.attention - self.kda_attention) // max(1, cfg.num_mla_layers)
        kda = self.kda_attention // max(1, cfg.num_kda_layers)
        per_layer = max(mla, kda) + (self.norms + self.attn_res) // max(1, cfg.num_layers)
        ffn = [cfg_block_ffn(cfg, moe=False)] if cfg.num_dense_layers else []
        ffn += [cfg_block_ffn(cfg, moe=True)] if cfg.num_moe_layers else []
        return per_layer + max(ffn)


def cfg_block_ffn(cfg: ModelConfig, moe: bool) -> int:
    D = cfg.hidden_size
    if not moe:
        return 3 * D * cfg.dense_intermediate_size
    latent = 2 * D * cfg.moe_latent_size if cfg.moe_latent_size is not None else 0
    return cfg.num_experts * D + latent + 3 * D * cfg.num_shared_experts * cfg.moe_intermediate_size


def count_params(cfg: ModelConfig) -> ParamCounts:
    with torch.device("meta"):
        model = K3Model(cfg, device="meta")
    buckets = {k: 0 for k in ("embedding", "attention", "kda_attention", "dense_ffn", "routed_experts",
                              "shared_experts", "router_and_latent", "norms", "attn_res")}
    kda_prefixes = tuple(f"layers.{i}.attn." for i in range(cfg.num_layers) if cfg.layer_is_kda(i))
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith(kda_prefixes) and not name.endswith("norm.weight"):
            buckets["kda_attention"] += n
        if name.startswith("final_res.") or ".res_attn." in name or ".res_ffn." in name:
            buckets["attn_res"] += n
        elif ".experts.master." in name:
            buckets["routed_experts"] += n
        elif name.endswith("norm.weight"):
            buckets["norms"] += n
        elif name.startswith(("embed.", "lm_head.")):
            buckets["embedding"] += n
        elif ".attn." in name:
            buckets["attention"] += n
        elif ".ffn.shared." in name:
            buckets["shared_experts"] += n
        elif ".ffn.router." in name or ".ffn.latent_" in name:
            buckets["router_and_latent"] += n
        else:
            buckets["dense_ffn"] += n
    counts = ParamCounts(**buckets, active=0)
    per_expert = 3 * cfg.expert_width * cfg.moe_intermediate_size
    counts.active = counts.total - counts.routed_experts + cfg.num_moe_layers * cfg.num_experts_per_tok * per_expert
    return counts
