"""config.json of a Hugging Face model directory <-> moontrain's ModelConfig.

Export writes the DeepSeek-V3 / Kimi K2 field names (plus moontrain's extra switches, see
moontrain/hf/configuration_moontrain.py) and the whole ModelConfig under `moontrain_model`, so an
exported model imports back to the very same config. Import reads model_type moontrain, deepseek_v3
and kimi_k2 configs; what moontrain cannot express (dense-only routing choices, biases, tied
embeddings, another activation) is refused with the field named.
"""

from __future__ import annotations

from typing import Any

from moontrain.checkpoint.tensors import CheckpointError
from moontrain.dataclass_dict import from_dict, to_dict
from moontrain.model.config import ModelConfig, YarnConfig, saved_model_dict

MODEL_TYPE = "moontrain"
IMPORTABLE = ("moontrain", "deepseek_v3", "kimi_k2")
# ModelConfig fields that do not change what the weights compute (training settings): a recipe may differ
# from an imported model in these (the execution settings are not in ModelConfig: KernelsConfig)
NOT_ARCHITECTURE = frozenset({"init_std", "init_embed_std", "router_bias_update_rate", "router_bias_update",
                              "router_mean_free_updates", "seq_aux_loss_coef"})


def hf_config(cfg: ModelConfig, *, dtype: str, max_position_embeddings: int, extra: dict[str, Any]) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_yarn is not None:
        y = cfg.rope_yarn
        rope.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_position,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return {
        "architectures": ["MoontrainForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": {"AutoConfig": "configuration_moontrain.MoontrainConfig",
                     "AutoModelForCausalLM": "modeling_moontrain.MoontrainForCausalLM"},
        "dtype": dtype,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.num_dense_layers,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.num_expert_groups,
        "topk_group": cfg.topk_expert_groups,
        "norm_topk_prob": True,
        "rms_norm_eps": cfg.norm_eps,
        "mla_norm_eps": cfg.mla_eps,
        "rope_parameters": rope,
        "rope_interleave": True,
        "use_nope": cfg.use_nope,
        "attn_output_gate": cfg.attn_output_gate,
        "moe_latent_size": cfg.moe_latent_size,
        "hidden_act": "situ_glu" if cfg.ffn_activation == "situ_glu" else "silu",
        "attn_res_block_size": cfg.attn_res_block_size,
        "kda_layers_per_mla": cfg.kda_layers_per_mla,
        "kda_num_heads": cfg.kda_heads,
        "kda_head_dim": cfg.kda_head_dim,
        "kda_conv_size": cfg.kda_conv_size,
        "kda_gate_rank": cfg.kda_gate_rank,
        "kda_gate_lower_bound": cfg.kda_gate_lower_bound,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "max_position_embeddings": max_position_embeddings,
        "use_cache": False,  # the HF modeling code has no KV cache: generate() re-runs the whole sequence
        **extra,
        "moontrain_model": to_dict(cfg),
    }


def model_config(raw: dict[str, Any], where: str) -> ModelConfig:
    """The ModelConfig of an HF config.json (`where` names the file in errors)."""
    model_type = raw.get("model_type")
    if model_type not in IMPORTABLE:
        raise CheckpointError(f"{where}: model_type {model_type!r} cannot be imported; moontrain reads {list(IMPORTABLE)}")
    if model_type == MODEL_TYPE and "moontrain_model" in raw:
        return from_dict(ModelConfig, saved_model_dict(raw["moontrain_model"]), "moontrain_model")
    refuse = {"norm_topk_prob": (raw.get("norm_topk_prob", True), True),
              "hidden_act": (raw.get("hidden_act", "silu"), "silu"),
              "attention_bias": (raw.get("attention_bias", False), False),
              "tie_word_embeddings": (raw.get("tie_word_embeddings", False), False),
              "scoring_func": (raw.get("scoring_func", "sigmoid"), "sigmoid"),
              "topk_method": (raw.get("topk_method", "noaux_tc"), "noaux_tc"),
              "moe_layer_freq": (raw.get("moe_layer_freq", 1), 1)}
    for key, (value, supported) in refuse.items():
        if value != supported:
            raise CheckpointError(f"{where}: {key}={value!r} is not supported (moontrain models have {supported!r})")
    n_group = raw.get("n_group") or 1
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"],
        num_dense_layers=raw.get("first_k_dense_replace") or 0, dense_intermediate_size=raw["intermediate_size"],
        norm_eps=raw.get("rms_norm_eps", 1e-6), init_std=raw.get("initializer_range", 0.02),
        num_heads=raw["num_attention_heads"], q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"], use_nope=raw.get("use_nope", False),
        attn_output_gate=raw.get("attn_output_gate", False), rope_theta=float(_rope(raw, where)[0]),
        rope_yarn=_rope(raw, where)[1], mla_norm_eps=raw.get("mla_norm_eps") or 1e-6,
        num_experts=raw["n_routed_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
        num_shared_experts=raw.get("n_shared_experts") or 0, moe_intermediate_size=raw["moe_intermediate_size"],
        moe_latent_size=raw.get("moe_latent_size"), routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_expert_groups=n_group, topk_expert_groups=raw.get("topk_group") or n_group,
    )


def _rope(raw: dict[str, Any], where: str) -> tuple[float, YarnConfig | None]:
    """(theta, YaRN or None) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older)."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_type", params.pop("type", "default"))
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    kind = params.get("rope_type", "default")
    if kind == "default":
        return params["rope_theta"], None
    if kind != "yarn" or params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise CheckpointError(f"{where}: rope {params} is not supported (moontrain has default and yarn rope)")
    yarn = from_dict(YarnConfig, {"factor": float(params["factor"]),
                                  "original_max_position": params["original_max_position_embeddings"],
                                  "beta_fast": float(params.get("beta_fast") or 32),
                                  "beta_slow": float(params.get("beta_slow") or 1),
                                  "mscale": float(params.get("mscale") or 0.0),
                                  "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0)}, "rope_yarn")
    return params["rope_theta"], yarn


def architecture_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """model.<field> (a vs b) for every architecture field where the two configs differ."""
    da, db = to_dict(a), to_dict(b)
    return [f"model.{k} ({da[k]!r} vs {db[k]!r})" for k in da if k not in NOT_ARCHITECTURE and da[k] != db[k]]
