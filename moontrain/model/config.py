"""Model configuration for the K3-like decoder (KDA / gated MLA attention, dense FFN first, latent MoE after):
the architecture (ModelConfig), the kernels that run it (KernelsConfig) and the routed experts' execution
(ExpertsConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from moonep import BufferOptions

FFNActivation = Literal["swiglu", "situ_glu"]


@dataclass(kw_only=True, slots=True)
class YarnConfig:
    """YaRN context extension of the rope dims (the `yarn` rope scaling of DeepSeek-V3 / Kimi K2).

    Frequencies between the beta_fast and beta_slow rotation counts (over original_max_position) blend
    from extrapolated to interpolated by `factor`. With m(x) = 0.1 x ln(factor) + 1: cos/sin are scaled
    by m(mscale) / m(mscale_all_dim) (m(1) when either is 0), and a nonzero mscale_all_dim multiplies the
    softmax scale by m(mscale_all_dim)^2."""

    factor: float  # context extension factor (>= 1)
    original_max_position: int  # the context length before the extension
    beta_fast: float = 32.0  # dims with more rotations than this over original_max_position extrapolate
    beta_slow: float = 1.0  # dims with fewer rotations than this are interpolated by factor
    mscale: float = 1.0  # cos/sin scale m(mscale) / m(mscale_all_dim)
    mscale_all_dim: float = 0.0  # nonzero: also the softmax scale times m(mscale_all_dim)^2

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"model.rope_yarn.factor must be >= 1, got {self.factor}")
        if self.original_max_position < 1:
            raise ValueError(f"model.rope_yarn.original_max_position must be >= 1, got {self.original_max_position}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model: its architecture and its training settings (init, router balancing:
    moontrain.checkpoint.hf_config.NOT_ARCHITECTURE). A checkpoint saves it; a resumed run must match it whole,
    an imported model in its architecture."""

    # keys that left ModelConfig. Each was a setting that never changed what the weights compute, so a
    # checkpoint or HF export that still carries one loads without it (saved_model_dict); a recipe naming one
    # is refused with its replacement
    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "kda_kernel": "write kernels.kda=auto|torch|fla instead (kernels: the execution choices)",
        "router_tf32": "write kernels.router_gemm=split_bf16|fp32 instead (kernels: the execution choices)",
        "attn_pad_head_dims": "write kernels.attn_pad_head_dims instead (kernels: the execution choices)",
        "router_skew": "the forced routing skew is a benchmark's setting (benchmarks/bench_train.py sets it on "
                       "the routers, Router.set_skew); drop it from the recipe",
    }

    # keys that joined ModelConfig after checkpoints were written: a saved mapping without one was trained
    # the way moontrain worked before the key existed (saved_model_dict fills that in, so resuming such a
    # checkpoint under today's defaults is refused with the key named, not silently switched)
    ADDED_KEYS: ClassVar[dict[str, Any]] = {"router_mean_free_updates": False, "router_bias_update": "sign"}

    vocab_size: int  # token ids 0 .. vocab_size - 1 (embedding rows, LM-head outputs)
    hidden_size: int  # D, the width of the residual stream
    num_layers: int  # transformer blocks
    num_dense_layers: int = 1  # the first layers use a dense gated FFN instead of MoE
    dense_intermediate_size: int  # the dense FFN's inner width
    # gated activation of every FFN (dense, shared and routed experts): silu(g) * u, or K3's SiTU-GLU
    # 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25) (moonep.situ_glu)
    ffn_activation: FFNActivation = "swiglu"
    # Block Attention Residuals (arXiv 2603.15031): sub-layers per block (attention and FFN count one
    # each, so a block is attn_res_block_size / 2 transformer layers; K3: 12). 0: standard residuals
    attn_res_block_size: int = 0
    norm_eps: float = 1e-6  # RMSNorm's epsilon
    # init (moontrain.model.init): matrices N(0, init_std^2), residual writers and routers depth-scaled,
    # the token embedding N(0, init_embed_std^2) so that it dominates the residual stream at init
    init_std: float = 0.02
    init_embed_std: float = 1.0  # see init_std
    # MLA attention
    num_heads: int
    q_lora_rank: int | None = None  # None: a full-rank q projection
    kv_lora_rank: int  # width of the compressed kv latent every head's keys and values expand from
    qk_nope_head_dim: int  # per head: query/key dims without rotation
    qk_rope_head_dim: int  # per head: query/key dims rotated by rope (even; one rope key shared by all heads)
    v_head_dim: int  # per head: value dims
    use_nope: bool = False  # True: no positional rotation at all (the rope dims stay, unrotated)
    attn_output_gate: bool = True  # sigmoid(x W_g) * attention output, per head and channel
    rope_theta: float = 50000.0  # rope's base
    rope_yarn: YarnConfig | None = None  # None: plain rope
    mla_norm_eps: float | None = None  # eps of the q and kv latent norms (None: norm_eps; DeepSeek-V3/K2: 1e-6)
    # hybrid layout: n Kimi Delta Attention (KDA) layers, then one MLA layer, repeated; the last layer is
    # always MLA (global attention at the top). 0: every layer MLA. K3: 3 (93 layers = 69 KDA + 24 MLA)
    kda_layers_per_mla: int = 0
    kda_num_heads: int | None = None  # None: num_heads
    kda_head_dim: int = 128  # key and value head dim of KDA (fla's kernel takes <= 256)
    kda_conv_size: int = 4  # causal depthwise short convolution on q, k and v
    # None: full-rank forget-gate and output-gate projections D -> heads x head dim (K3); r: low rank
    # D -> r -> heads x head dim (Kimi Linear, r = head dim)
    kda_gate_rank: int | None = None
    # decay g = bound * sigmoid(exp(A_log) (f + dt_bias)) in [bound, 0] (K3: -5); None: the unbounded
    # g = -exp(A_log) softplus(f + dt_bias) of Kimi Linear
    kda_gate_lower_bound: float | None = -5.0
    # packed rows: attention and the KDA state stop at each end-of-document token of the token source
    # (no effect with a source without documents, e.g. data.source=markov)
    document_mask: bool = True
    # MoE
    num_experts: int  # E, routed experts per MoE layer (a multiple of parallel.ep)
    num_experts_per_tok: int  # K, the routed experts each token goes to (top-k)
    num_shared_experts: int = 0  # experts every token goes to (one gated FFN num_shared_experts times as wide)
    moe_intermediate_size: int  # the inner width of each routed and shared expert
    moe_latent_size: int | None = None  # routed experts run at this width between down and up projections
    routed_scaling_factor: float = 1.0  # route weights (renormalised over the K chosen) are multiplied by this
    # group-limited routing (DeepSeek-V3): experts form num_expert_groups equal groups, each scored by the
    # sum of its two best selection scores; a token picks its top-k among the topk_expert_groups best groups
    num_expert_groups: int = 1
    topk_expert_groups: int = 1  # see num_expert_groups
    router_bias_update_rate: float = 1e-2  # aux-loss-free balancing step on the score-correction bias
    # how the bias moves after a step: "proportional" (rate * (mean - count_e) / mean: an expert's correction
    # grows with its imbalance) or "sign" (DeepSeek-V3's rate * sign(mean - count_e); its paper: rate 1e-3).
    # docs/learning.md: on one H200 proportional 1e-2 keeps maxvio <= 1.3 from step 20 where sign 1e-3 gave 3.9
    router_bias_update: str = "proportional"
    # optimizer steps leave each router's weights along the step's mean router input unchanged: expert
    # popularity moves through the bias only (moontrain.model.router_updates; false: plain updates)
    router_mean_free_updates: bool = True
    seq_aux_loss_coef: float = 0.0  # sequence-wise balance loss (DeepSeek-V3); 0 disables it

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank", "v_head_dim",
                     "qk_nope_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "dense_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(
                f"model.num_dense_layers={self.num_dense_layers} must be in [0, num_layers={self.num_layers}]"
            )
        if self.ffn_activation not in ("swiglu", "situ_glu"):
            raise ValueError(f"model.ffn_activation must be 'swiglu' or 'situ_glu', got {self.ffn_activation!r}")
        if self.attn_res_block_size < 0 or self.attn_res_block_size % 2:
            raise ValueError(
                f"model.attn_res_block_size must be an even number of sub-layers >= 2 (K3: 12), or 0 for standard "
                f"residuals; got {self.attn_res_block_size}"
            )
        if self.router_bias_update not in ("sign", "proportional"):
            raise ValueError(
                f"model.router_bias_update must be 'sign' or 'proportional', got {self.router_bias_update!r}"
            )
        for name in ("norm_eps", "init_std", "init_embed_std", "rope_theta"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"model.{name} must be a finite number > 0, got {getattr(self, name)}")
        for name in ("router_bias_update_rate", "seq_aux_loss_coef", "routed_scaling_factor"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"model.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim must be even and >= 0, got {self.qk_rope_head_dim}")
        if self.kda_layers_per_mla < 0:
            raise ValueError("model.kda_layers_per_mla must be >= 0 (0: every layer MLA), got "
                             f"{self.kda_layers_per_mla}")
        for name in ("kda_num_heads", "kda_gate_rank"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1 or null, got {getattr(self, name)}")
        if not 1 <= self.kda_head_dim <= 256:
            raise ValueError(f"model.kda_head_dim must be in [1, 256] (fla's chunk_kda), got {self.kda_head_dim}")
        if self.kda_conv_size < 1:
            raise ValueError(f"model.kda_conv_size must be >= 1, got {self.kda_conv_size}")
        if self.kda_gate_lower_bound is not None and not self.kda_gate_lower_bound < 0:
            raise ValueError(f"model.kda_gate_lower_bound must be < 0 (or null: unbounded), "
                             f"got {self.kda_gate_lower_bound}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        groups, top_groups = self.num_expert_groups, self.topk_expert_groups
        if groups > 1 and (self.num_experts % groups or self.num_experts // groups < 2):
            raise ValueError(f"model.num_expert_groups={groups} must divide num_experts={self.num_experts} into "
                             "groups of at least 2 experts; use 1 to turn group-limited routing off")
        if not 1 <= top_groups <= groups or top_groups * (self.num_experts // groups) < self.num_experts_per_tok:
            raise ValueError(f"model.topk_expert_groups={top_groups} must be in [1, num_expert_groups={groups}] and "
                             f"its groups must hold num_experts_per_tok={self.num_experts_per_tok} experts")
        elems = self.expert_width * self.moe_intermediate_size
        if elems % 2048:
            raise ValueError(
                f"expert shape {self.expert_width}x{self.moe_intermediate_size} has {elems} elements, not a "
                "multiple of 2048 (moonep maps expert rows at 4 KiB / 2 MiB granularity); change "
                "model.moe_intermediate_size or model.moe_latent_size/hidden_size"
            )

    @property
    def expert_width(self) -> int:
        """Width H seen by the routed experts: the latent width when the latent projection is on."""
        return self.moe_latent_size if self.moe_latent_size is not None else self.hidden_size

    def layer_is_kda(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` (0-based) is KDA: with n = kda_layers_per_mla, layers l = 1, 2, ...
        (1-based) with l % (n + 1) == 0, and the last layer, are MLA."""
        n = self.kda_layers_per_mla
        return n > 0 and (layer_idx + 1) % (n + 1) != 0 and layer_idx != self.num_layers - 1

    @property
    def num_kda_layers(self) -> int:
        return sum(self.layer_is_kda(i) for i in range(self.num_layers))

    @property
    def num_mla_layers(self) -> int:
        return self.num_layers - self.num_kda_layers

    @property
    def kda_heads(self) -> int:
        return self.kda_num_heads if self.kda_num_heads is not None else self.num_heads

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_eps(self) -> float:
        return self.norm_eps if self.mla_norm_eps is None else self.mla_norm_eps


def saved_model_dict(saved: dict[str, Any]) -> dict[str, Any]:
    """A ModelConfig mapping as a checkpoint or an HF export of any moontrain version holds it, less the keys
    that have left ModelConfig (RETIRED_KEYS: execution settings, never part of what the weights compute),
    with the keys that joined it later at the value it was trained with (ADDED_KEYS)."""
    kept = {k: v for k, v in saved.items() if k not in ModelConfig.RETIRED_KEYS}
    return {**ModelConfig.ADDED_KEYS, **kept}


SHORT_CONV_WALK_TAPS = 4  # the most taps kernels.short_conv_backward=walk takes (its taps live in registers)


@dataclass(kw_only=True, slots=True)
class KernelsConfig:
    """How the model's layers run: the same math in other kernels, orders and precisions. None of it is part
    of the weights or the checkpoint: a run may resume or import with other choices."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "router_tf32": "write kernels.router_gemm=split_bf16 (bf16 tensor cores, the default) or "
                       "kernels.router_gemm=fp32 (IEEE fp32) instead: the TF32 route was replaced",
    }

    # KDA layers: "auto" runs fla's chunk_kda (Triton) on CUDA when fla-core is installed, else the pure-PyTorch
    # chunked KDA (moontrain.model.kda.ops, the specification); "torch" / "fla" force one
    kda: Literal["auto", "torch", "fla"] = "auto"
    # False (the default) keeps the forward's chunk states and WY factors for fla's KDA backward (fla's
    # disable_recompute: ~0.41 ms less a layer call at k3_small's pass, ~36 KiB more activation memory a token a
    # KDA layer: docs/performance.md); True recomputes them in the backward (less memory). The PyTorch KDA keeps
    # what autograd keeps either way
    kda_recompute: bool = False
    # the kernel of fla's KDA backward stage for dq, dk, dg, db and the WY matrix's grad (its slowest):
    # "moontrain" (moontrain.model.kda.dqkg_kernel: the same outputs, ~1.9x faster at k3_small's shapes:
    # docs/kda.md) or "fla" (fla's chunk_kda_bwd_wy_dqkg_fused). Only where the KDA layers run fla; process-wide
    kda_dqkg: Literal["fla", "moontrain"] = "moontrain"
    # the kernel of fla's KDA backward stage that adds the intra-chunk matrices' part to dq, dk, db and dg:
    # "fla_k64" (fla's kernel launched with 64-wide K-blocks, moontrain.model.kda.intra_fla: dq, dk, dg bitwise
    # fla's; at k3_small's pass the stage 0.2 ms faster, a KDA call 0.06-0.1 ms: docs/kda.md), "fla" (fla's
    # chunk_kda_bwd_intra, 32-wide), "moontrain" (moontrain.model.kda.intra_norm_kernel: the stage and the L2
    # norms' backward in one kernel, dq and dk stored once in their dtype; with kda_gate_norm=moontrain and a
    # gate lower bound in [-10, 0)), "auto" (moontrain where it applies, else fla_k64: moontrain.model.kda.layer's
    # resolve_intra). Only where the KDA layers run fla; fla's two: process-wide
    kda_intra: Literal["auto", "fla", "fla_k64", "moontrain"] = "auto"
    # the two elementwise ends of the KDA call (q and k's L2 norms, the gate and its chunk-local cumulative sum,
    # and their backward): "moontrain" (moontrain.model.kda.chunk: fla's stages between moontrain's Triton
    # kernels, one launch at each end instead of three forward and six backward, f read in place; with
    # kda_intra=auto a call 0.18 ms faster than fla's on an H100: docs/kda.md) or "fla" (fla's chunk_kda). Only
    # where the KDA layers run fla
    kda_gate_norm: Literal["fla", "moontrain"] = "moontrain"
    # the KDA forward's state walk and output: "fla" (fla's chunk_gated_delta_rule_fwd_h, then chunk_gla_fwd_o_gk
    # reading back the h and v_new it wrote), "moontrain" (moontrain.model.kda.walk_kernel: both in one walk, the
    # same outputs bitwise, 0.10-0.16 ms less a call on an H100: docs/kda.md; with kda_gate_norm=moontrain) or
    # "auto" (moontrain on moontrain's KDA call, kda_gate_norm=moontrain, else fla). Only where the KDA layers run fla
    kda_walk: Literal["auto", "fla", "moontrain"] = "auto"
    # KDA's causal short convolutions (+ SiLU): "auto" runs the Triton kernel (moontrain.model.kda.short_conv_kernel)
    # on CUDA, else the PyTorch specification (moontrain.model.kda.short_conv); "torch" / "triton" force one
    short_conv: Literal["auto", "torch", "triton"] = "auto"
    # the Triton convolution's backward: "walk" (one kernel whose programs walk their rows down with the taps in
    # registers: dx and dw in one pass, no dpre tensor; at most SHORT_CONV_WALK_TAPS taps) or "tiles" (a dpre kernel
    # over [time, channel] tiles, its dpre written and read back by a dx kernel; any number of taps). Only where the
    # Triton convolution runs (the two in the K3 step: docs/performance.md)
    short_conv_backward: Literal["tiles", "walk"] = "walk"
    # AttnRes aggregations (model.attn_res_block_size): "auto" runs the Triton kernels (moontrain.model.attn_res_kernel)
    # on CUDA and the PyTorch math elsewhere; "torch" the PyTorch math (compiled with train.compile), "triton" the
    # kernels (the K3 step with them and without: docs/performance.md)
    attn_res: Literal["auto", "torch", "triton"] = "auto"
    # the fused head's per-chunk cross-entropy and logits gradient (moontrain.model.lm_loss): "triton" runs the
    # Triton kernels (moontrain.model.lm_loss_kernel), "torch" the PyTorch math (compiled with train.compile),
    # "auto" the kernels on CUDA and the PyTorch math elsewhere (the K3 step with them: docs/performance.md)
    lm_loss: Literal["auto", "torch", "triton"] = "auto"
    # the router's fp32 logits GEMM and its backward: "split_bf16" runs them on bf16 tensor cores where the
    # activations are bf16 on CUDA (moontrain.model.router.RouterLogits: each fp32 operand as two bf16 terms,
    # within 2^-16 of it; no fp32 copy of the router's input), "fp32" as IEEE fp32 GEMMs (cuBLAS on FFMA on
    # CUDA; the cost: docs/performance.md). The CPU and fp32 activations run fp32 either way
    router_gemm: Literal["split_bf16", "fp32"] = "split_bf16"
    # the router's selection, weights and counts and their backward: "auto" runs moontrain.model.router_kernel's
    # two Triton kernels on CUDA (bf16 activations and weights, router_gemm=split_bf16, no expert groups, no
    # sequence aux loss; ~30 launches fewer per MoE layer and pass) and the PyTorch math elsewhere, "torch" the
    # PyTorch math, "triton" the kernels (their measurements and the K3 learning run: docs/performance.md)
    router: Literal["auto", "torch", "triton"] = "auto"
    # zero-pad q/k and v to one head dim before SDPA (flash attention wants equal dims). Off: SDPA gets
    # qk_head_dim and v_head_dim as they are (cuDNN and memory-efficient attention take them; the padded
    # call's cost: docs/performance.md)
    attn_pad_head_dims: bool = False

    def __post_init__(self) -> None:
        if self.kda not in ("auto", "torch", "fla"):
            raise ValueError(f"kernels.kda must be 'auto', 'torch' or 'fla', got {self.kda!r}")
        if self.kda_dqkg not in ("fla", "moontrain"):
            raise ValueError(f"kernels.kda_dqkg must be 'fla' or 'moontrain', got {self.kda_dqkg!r}")
        if self.kda_intra not in ("auto", "fla", "fla_k64", "moontrain"):
            raise ValueError(f"kernels.kda_intra must be 'auto', 'fla', 'fla_k64' or 'moontrain', got "
                             f"{self.kda_intra!r}")
        if self.kda_gate_norm not in ("fla", "moontrain"):
            raise ValueError(f"kernels.kda_gate_norm must be 'fla' or 'moontrain', got {self.kda_gate_norm!r}")
        if self.kda_intra == "moontrain" and self.kda_gate_norm != "moontrain":
            raise ValueError("kernels.kda_intra=moontrain applies the L2 norms' backward that moontrain's "
                             "gate-and-norm route leaves to it: set kernels.kda_gate_norm=moontrain too (got "
                             f"{self.kda_gate_norm!r}), or kernels.kda_intra=fla_k64")
        if self.kda_walk not in ("auto", "fla", "moontrain"):
            raise ValueError(f"kernels.kda_walk must be 'auto', 'fla' or 'moontrain', got {self.kda_walk!r}")
        if self.kda_walk == "moontrain" and self.kda_gate_norm != "moontrain":
            raise ValueError("kernels.kda_walk=moontrain runs inside moontrain's KDA call: set "
                             f"kernels.kda_gate_norm=moontrain too (got {self.kda_gate_norm!r}), or kernels.kda_walk=fla")
        if self.short_conv not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels.short_conv must be 'auto', 'torch' or 'triton', got {self.short_conv!r}")
        if self.short_conv_backward not in ("tiles", "walk"):
            raise ValueError(f"kernels.short_conv_backward must be 'tiles' or 'walk', got {self.short_conv_backward!r}")
        if self.attn_res not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels.attn_res must be 'auto', 'torch' or 'triton', got {self.attn_res!r}")
        if self.lm_loss not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels.lm_loss must be 'auto', 'torch' or 'triton', got {self.lm_loss!r}")
        if self.router not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels.router must be 'auto', 'torch' or 'triton', got {self.router!r}")
        if self.router_gemm not in ("split_bf16", "fp32"):
            raise ValueError(f"kernels.router_gemm must be 'split_bf16' or 'fp32', got {self.router_gemm!r}")


ExpertsBackendName = Literal["local", "alltoall", "moonep"]


@dataclass(kw_only=True, slots=True)
class ExpertsConfig:
    """How routed experts are computed and where their tokens travel."""

    # local: every expert on each rank (parallel.ep=1; the reference the others are tested against); alltoall:
    # NCCL all-to-all dispatch and combine (as torchtitan); moonep: moonep's balanced EP (moontrain.model.experts)
    backend: ExpertsBackendName = "alltoall"
    token_padding: int = 16  # each expert's row group is padded to this many rows (grouped-GEMM alignment)
    moonep: BufferOptions = field(default_factory=BufferOptions)  # how the moonep backend's Buffer runs

    def __post_init__(self) -> None:
        if self.token_padding < 1:
            raise ValueError(f"experts.token_padding must be >= 1, got {self.token_padding}")
