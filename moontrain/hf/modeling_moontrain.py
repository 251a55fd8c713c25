"""Hugging Face modeling code of a moontrain model: MLA attention (optional q low rank, output gate, NoPE,
YaRN), dense gated-FFN first layers (SwiGLU, or SiTU-GLU with hidden_act="situ_glu"), then sigmoid-routed
MoE (optional group-limited routing, latent projection, shared experts), optionally Block Attention
Residuals (attn_res_block_size > 0: each sub-layer's input a softmax over depth of the completed blocks,
the embedding first, and the current block's partial sum, with a zero-initialised pseudo-query), and
Kimi Delta Attention layers (kda_layers_per_mla > 0; recurrent form, token by token). Loaded with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.

Legend: B batch, T sequence, D hidden, N heads, Dn/Dr/Dv nope/rope/value head dims, E experts, K top-k,
s = B*T tokens, H expert width (the latent width with moe_latent_size).

Weight names and layouts are those of DeepSeek-V3 / Kimi K2 checkpoints (nn.Linear [out, in], one module
per expert, rope rows interleaved when rope_interleave), plus self_attn.g_proj (output gate) and
mlp.latent_down_proj / latent_norm / latent_up_proj (latent MoE). Norms, routing and rope run in fp32
whatever the weights' dtype, as in moontrain's trainer. No KV cache: generate() with use_cache=False.
This file is copied next to the weights by `moontrain export`; it imports only torch and transformers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_moontrain import MoontrainConfig


class MoontrainRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(config: MoontrainConfig, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, Dr/2] (fp32) of the given positions, with YaRN when rope_parameters says so."""
    params, dim = config.rope_parameters, config.qk_rope_head_dim
    theta = params["rope_theta"]
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    scale = 1.0
    if params.get("rope_type", "default") == "yarn":
        factor, original = params["factor"], params["original_max_position_embeddings"]
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + inv_freq * keep
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        scale = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                 else _mscale(factor, 1.0))
    angles = torch.outer(positions_T.float(), inv_freq.to(positions_T.device))
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x [..., T, Dr]; pairs (2i, 2i+1) when interleaved, else (i, i + Dr/2). The
    result is in half-split order either way (q and k alike, so the scores do not depend on it)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    x1, x2 = x1.float(), x2.float()
    return torch.cat([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MoontrainAttention(nn.Module):
    def __init__(self, config: MoontrainConfig) -> None:
        super().__init__()
        self.config = config
        D, N = config.hidden_size, config.num_attention_heads
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        mla_eps = config.rms_norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, N * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = MoontrainRMSNorm(config.q_lora_rank, mla_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, N * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = MoontrainRMSNorm(config.kv_lora_rank, mla_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, N * (config.qk_nope_head_dim + config.v_head_dim), bias=False)
        if config.attn_output_gate:
            self.g_proj = nn.Linear(D, N * config.v_head_dim, bias=False)
        self.o_proj = nn.Linear(N * config.v_head_dim, D, bias=False)
        self.scaling = 1.0 / math.sqrt(qk)
        params = config.rope_parameters
        if params.get("rope_type", "default") == "yarn" and params.get("mscale_all_dim"):
            m = _mscale(params["factor"], params["mscale_all_dim"])
            self.scaling = self.scaling * m * m

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x_BTD.shape
        N, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_nope, q_rope = q.view(B, T, N, Dn + Dr).transpose(1, 2).split([Dn, Dr], dim=-1)
        c_BTC, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([cfg.kv_lora_rank, Dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_BTC)).view(B, T, N, Dn + Dv).transpose(1, 2)
        k_nope, v = kv.split([Dn, Dv], dim=-1)
        k_rope = k_rope.unsqueeze(1)
        if Dr and not cfg.use_nope:
            q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
            k_rope = apply_rope(k_rope, cos, sin, cfg.rope_interleave)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, N, T, Dr)], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scaling)
        o = o.transpose(1, 2).reshape(B, T, N * Dv)
        if cfg.attn_output_gate:
            o = o * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o)


class MoontrainShortConv(nn.Module):
    """Causal depthwise convolution then silu: weight [C, W], tap s multiplies x_{t-s}."""

    def __init__(self, channels: int, taps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, taps))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        T, W = x_BTC.shape[1], self.weight.shape[1]
        w = self.weight.to(x_BTC.dtype)
        y = x_BTC * w[:, 0]
        for s in range(1, min(W, T)):
            y = y + F.pad(x_BTC, (0, 0, s, 0))[:, :T] * w[:, s]
        return F.silu(y)


class MoontrainKDA(nn.Module):
    """Kimi Delta Attention, recurrent form: per head, with decay a_t = exp(g_t) per key channel and write
    strength beta_t, S_t = diag(a_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = S_t^T q_t / sqrt(K),
    q and k L2-normalised; out = (RMSNorm(o) * sigmoid(g_proj x)) o_proj. No positional encoding."""

    def __init__(self, config: MoontrainConfig) -> None:
        super().__init__()
        self.config = config
        D, H, K, W, r = (config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.kda_conv_size,
                         config.kda_gate_rank)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, H * K, bias=False) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = (MoontrainShortConv(H * K, W) for _ in range(3))
        if r is None:
            self.f_proj, self.g_proj = nn.Linear(D, H * K, bias=False), nn.Linear(D, H * K, bias=False)
        else:
            self.f_a_proj, self.f_b_proj = nn.Linear(D, r, bias=False), nn.Linear(r, H * K, bias=False)
            self.g_a_proj, self.g_b_proj = nn.Linear(D, r, bias=False), nn.Linear(r, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H, K))
        self.o_norm = MoontrainRMSNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def _low_rank(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.config.kda_gate_rank is None:
            return getattr(self, f"{name}_proj")(x)
        return getattr(self, f"{name}_b_proj")(getattr(self, f"{name}_a_proj")(x))

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x_BTD.shape
        H, K = cfg.kda_num_heads, cfg.kda_head_dim

        def l2(t: torch.Tensor) -> torch.Tensor:
            t = t.float()
            return t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6)

        q = l2(self.q_conv(self.q_proj(x_BTD)).view(B, T, H, K))
        k = l2(self.k_conv(self.k_proj(x_BTD)).view(B, T, H, K))
        v = self.v_conv(self.v_proj(x_BTD)).view(B, T, H, K)
        f = self._low_rank(x_BTD, "f").view(B, T, H, K).float() + self.dt_bias.float()
        a = self.A_log.float().exp().view(H, 1)
        bound = cfg.kda_gate_lower_bound
        g = -a * F.softplus(f) if bound is None else bound * torch.sigmoid(a * f)
        beta = torch.sigmoid(self.b_proj(x_BTD).float())
        S = x_BTD.new_zeros(B, H, K, K, dtype=torch.float32)
        outs = []
        for t in range(T):
            S = g[:, t].exp().unsqueeze(-1) * S
            u = beta[:, t].unsqueeze(-1) * (v[:, t].float() - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
            S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
        o = torch.stack(outs, dim=1)
        gate = self._low_rank(x_BTD, "g").view(B, T, H, K)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight.float()
        o = (o * torch.sigmoid(gate.float())).to(gate.dtype)
        return self.o_proj(o.reshape(B, T, H * K))


class MoontrainMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str = "silu") -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.act == "situ_glu":  # in fp32, rounded once, as moontrain's trainer computes it
            a = (4 * torch.tanh(g.float() / 4) * torch.sigmoid(g.float()) * (25 * torch.tanh(u.float() / 25)))
            return self.down_proj(a.to(x.dtype))
        return self.down_proj(F.silu(g) * u)


class MoontrainDepthAttention(nn.Module):
    """One AttnRes aggregation: softmax over depth of (pseudo-query . RMSNorm(value)), in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_norm = MoontrainRMSNorm(dim, eps)

    def forward(self, values: list[torch.Tensor]) -> torch.Tensor:
        v = torch.stack(values).float()
        k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.key_norm.eps) * self.key_norm.weight.float()
        alpha = torch.einsum("d,nbtd->nbt", self.query.float(), k).softmax(0)
        return torch.einsum("nbt,nbtd->btd", alpha, v).to(values[0].dtype)


class MoontrainRouter(nn.Module):
    """Sigmoid scores; selection adds the score-correction bias (and keeps the best groups); the combine
    weights are the unbiased scores of the chosen experts, renormalised, times routed_scaling_factor."""

    def __init__(self, config: MoontrainConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x_sD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        scores_sE = torch.sigmoid(F.linear(x_sD.float(), self.weight.float()))
        select_sE = scores_sE + self.e_score_correction_bias.float()
        if cfg.n_group > 1:
            s = select_sE.shape[0]
            select_sGe = select_sE.view(s, cfg.n_group, -1)
            group_sG = select_sGe.topk(2, dim=-1).values.sum(-1)
            keep_sG = torch.zeros_like(group_sG, dtype=torch.bool)
            keep_sG.scatter_(1, group_sG.topk(cfg.topk_group, dim=-1).indices, True)
            select_sE = select_sGe.masked_fill(~keep_sG.unsqueeze(-1), float("-inf")).view(s, -1)
        topk_sK = torch.topk(select_sE, cfg.num_experts_per_tok, dim=-1).indices
        weights_sK = scores_sE.gather(1, topk_sK)
        if cfg.norm_topk_prob:
            weights_sK = weights_sK / weights_sK.sum(-1, keepdim=True)
        return weights_sK * cfg.routed_scaling_factor, topk_sK


class MoontrainMoE(nn.Module):
    def __init__(self, config: MoontrainConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        H = config.moe_latent_size or D
        self.gate = MoontrainRouter(config)
        if config.moe_latent_size is not None:
            self.latent_down_proj = nn.Linear(D, H, bias=False)
            self.latent_norm = MoontrainRMSNorm(H, config.rms_norm_eps)
            self.latent_up_proj = nn.Linear(H, D, bias=False)
        self.experts = nn.ModuleList(MoontrainMLP(H, config.moe_intermediate_size, config.hidden_act)
                                     for _ in range(config.n_routed_experts))
        if config.n_shared_experts:
            self.shared_experts = MoontrainMLP(D, config.n_shared_experts * config.moe_intermediate_size,
                                               config.hidden_act)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_sD = x_BTD.reshape(B * T, D)
        weights_sK, topk_sK = self.gate(x_sD)
        latent = self.config.moe_latent_size is not None
        h_sH = self.latent_norm(self.latent_down_proj(x_sD)) if latent else x_sD
        s, K = topk_sK.shape
        y_sKH = h_sH.new_zeros(s, K, h_sH.shape[-1])
        for e in torch.unique(topk_sK).tolist():
            t, k = torch.nonzero(topk_sK == e, as_tuple=True)
            y_sKH[t, k] = self.experts[e](h_sH[t])
        y_sH = (y_sKH.float() * weights_sK.unsqueeze(-1)).sum(1).to(h_sH.dtype)
        y_sD = self.latent_up_proj(y_sH) if latent else y_sH
        if self.config.n_shared_experts:
            y_sD = y_sD + self.shared_experts(x_sD)
        return y_sD.view(B, T, D)


class MoontrainDecoderLayer(nn.Module):
    def __init__(self, config: MoontrainConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = MoontrainRMSNorm(config.hidden_size, config.rms_norm_eps)
        n, last = config.kda_layers_per_mla, layer_idx == config.num_hidden_layers - 1
        kda = n > 0 and (layer_idx + 1) % (n + 1) != 0 and not last
        self.self_attn = MoontrainKDA(config) if kda else MoontrainAttention(config)
        self.post_attention_layernorm = MoontrainRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoontrainMoE(config) if layer_idx >= config.first_k_dense_replace
                    else MoontrainMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
        block_size = config.attn_res_block_size
        if block_size:
            self.attn_res = MoontrainDepthAttention(config.hidden_size, config.rms_norm_eps)
            self.mlp_res = MoontrainDepthAttention(config.hidden_size, config.rms_norm_eps)
            self.starts_block = layer_idx % (block_size // 2) == 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_attn_res(self, blocks: list[torch.Tensor], partial: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, mask: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """AttnRes: (completed blocks, partial sum) -> the same after this layer."""
        h = self.attn_res([*blocks, partial])
        out = self.self_attn(self.input_layernorm(h), cos, sin, mask)
        if self.starts_block:
            blocks, partial = [*blocks, partial], out
        else:
            partial = partial + out
        h = self.mlp_res([*blocks, partial])
        return blocks, partial + self.mlp(self.post_attention_layernorm(h))


class MoontrainPreTrainedModel(PreTrainedModel):
    config_class = MoontrainConfig
    base_model_prefix = "model"
    _no_split_modules = ("MoontrainDecoderLayer",)
    _keep_in_fp32_modules_strict = ("e_score_correction_bias", "gate.weight")

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MoontrainRouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, MoontrainRMSNorm):
            nn.init.ones_(module.weight)


class MoontrainModel(MoontrainPreTrainedModel):
    def __init__(self, config: MoontrainConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoontrainDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MoontrainRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size:
            self.final_res = MoontrainDepthAttention(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        cos, sin = rope_tables(self.config, torch.arange(T, device=input_ids.device))
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
            eye = torch.eye(T, dtype=torch.bool, device=input_ids.device)  # a padding query sees itself, not NaN
            mask = (causal & attention_mask.bool()[:, None, None, :]) | eye
        x = self.embed_tokens(input_ids)
        if self.config.attn_res_block_size:
            blocks: list[torch.Tensor] = []
            for layer in self.layers:
                blocks, x = layer.forward_attn_res(blocks, x, cos, sin, mask)
            return self.norm(self.final_res([*blocks, x]))
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class MoontrainForCausalLM(MoontrainPreTrainedModel, GenerationMixin):
    def __init__(self, config: MoontrainConfig) -> None:
        super().__init__(config)
        self.model = MoontrainModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
