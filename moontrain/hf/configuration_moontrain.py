"""Hugging Face configuration of a moontrain model (loaded with trust_remote_code; needs only transformers).

Fields follow the DeepSeek-V3 / Kimi K2 config names where the two models agree; the extra switches of
moontrain's K3-like decoder are attn_output_gate, use_nope, moe_latent_size, mla_norm_eps,
hidden_act="situ_glu" (K3's 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25) in every FFN) and
attn_res_block_size (Block Attention Residuals, sub-layers per block; 0: standard residuals) and the
kda_* fields (Kimi Delta Attention layers: kda_layers_per_mla KDA layers before each MLA layer, the last
layer MLA; 0: every layer MLA).
This file is copied next to the weights by `moontrain export`; it imports nothing from moontrain.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class MoontrainConfig(PretrainedConfig):
    model_type = "moontrain"
    keys_to_ignore_at_inference = ("past_key_values",)

    def __init__(self, vocab_size: int = 257, hidden_size: int = 64, intermediate_size: int = 192,
                 moe_intermediate_size: int = 64, num_hidden_layers: int = 3, num_attention_heads: int = 4,
                 q_lora_rank: int | None = None, kv_lora_rank: int = 32, qk_nope_head_dim: int = 16,
                 qk_rope_head_dim: int = 8, v_head_dim: int = 16, n_routed_experts: int = 8,
                 num_experts_per_tok: int = 2, n_shared_experts: int = 0, first_k_dense_replace: int = 1,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, rms_norm_eps: float = 1e-6, mla_norm_eps: float | None = None,
                 rope_parameters: dict | None = None, rope_interleave: bool = True, use_nope: bool = False,
                 attn_output_gate: bool = False, moe_latent_size: int | None = None,
                 max_position_embeddings: int = 4096, hidden_act: str = "silu", initializer_range: float = 0.02,
                 tie_word_embeddings: bool = False, attn_res_block_size: int = 0, use_cache: bool = False,
                 kda_layers_per_mla: int = 0, kda_num_heads: int | None = None, kda_head_dim: int = 128,
                 kda_conv_size: int = 4, kda_gate_rank: int | None = None, kda_gate_lower_bound: float | None = -5.0,
                 **kwargs) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_shared_experts = n_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.rms_norm_eps = rms_norm_eps
        self.mla_norm_eps = mla_norm_eps
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 50000.0}
        self.rope_interleave = rope_interleave
        self.use_nope = use_nope
        self.attn_output_gate = attn_output_gate
        self.moe_latent_size = moe_latent_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.attn_res_block_size = attn_res_block_size
        self.kda_layers_per_mla = kda_layers_per_mla
        self.kda_num_heads = kda_num_heads or num_attention_heads
        self.kda_head_dim = kda_head_dim
        self.kda_conv_size = kda_conv_size
        self.kda_gate_rank = kda_gate_rank
        self.kda_gate_lower_bound = kda_gate_lower_bound
        self.use_cache = use_cache  # no KV cache in the modeling code: generate() re-runs the whole sequence
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
