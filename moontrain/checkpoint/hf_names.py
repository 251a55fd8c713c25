"""Tensor names and layouts between moontrain's canonical checkpoint and the Hugging Face (DeepSeek-V3 /
Kimi K2) convention.

    embed.weight                            model.embed_tokens.weight
    layers.i.attn_norm / ffn_norm           model.layers.i.input_layernorm / post_attention_layernorm
    layers.i.attn.{wq, wq_a, q_norm, wq_b}  model.layers.i.self_attn.{q_proj, q_a_proj, q_a_layernorm, q_b_proj}
    layers.i.attn.{wkv_a, kv_norm, wkv_b}   ... self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj}
    layers.i.attn.{wg, wo}                  ... self_attn.{g_proj, o_proj}
    layers.i.ffn.w_{gate,up,down}           ... mlp.{gate,up,down}_proj            (dense layers)
    layers.i.ffn.router.weight / score_bias_E   ... mlp.gate.weight / e_score_correction_bias
    layers.i.ffn.latent_{down,norm,up}      ... mlp.latent_down_proj / latent_norm / latent_up_proj
    layers.i.ffn.shared.w_{gate,up,down}    ... mlp.shared_experts.{gate,up,down}_proj
    layers.i.ffn.experts.master.gate_up [E,H,2F] ... mlp.experts.j.{gate,up}_proj.weight [F, H] per expert
                                            (gate_up[j] = [gate_proj.weight.T | up_proj.weight.T])
    layers.i.ffn.experts.master.down [E,F,H]    ... mlp.experts.j.down_proj.weight [H, F] per expert
    norm.weight, lm_head.weight             model.norm.weight, lm_head.weight
    layers.i.res_{attn,ffn}.query           model.layers.i.{attn,mlp}_res.query       (AttnRes pseudo-queries)
    layers.i.res_{attn,ffn}.key_norm.weight ... {attn,mlp}_res.key_norm.weight
    final_res.{query, key_norm.weight}      model.final_res.{query, key_norm.weight}

KDA layers (model.kda_layers_per_mla > 0; moontrain uses Kimi Linear's names and layouts):
    layers.i.attn.{q,k,v,f,f_a,f_b,b,g,g_a,g_b,o}_proj   model.layers.i.self_attn.<the same>
    layers.i.attn.{q,k,v}_conv1d [C, 1, W]  ... self_attn.{q,k,v}_conv1d.weight (nn.Conv1d's layout)
    layers.i.attn.{A_log, dt_bias, o_norm}  ... self_attn.{A_log, dt_bias, o_norm.weight}

Layout changes: expert projections are split per expert and transposed (gate_up also into its gate and
up column halves); the rope rows of the q projection (the last Dr rows of every head) and of the kv-a
projection (its last Dr rows) are stored with rotation pairs interleaved when the HF config says
rope_interleave (the DeepSeek-V3 / K2 layout), while moontrain rotates pairs (i, i + Dr/2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from moontrain.checkpoint.tensors import CheckpointError
from moontrain.model.config import ModelConfig
from moontrain.model.rope import half_split_to_interleaved, interleaved_to_half_split

_LAYER = r"layers\.(\d+)\."
_RULES: list[tuple[str, str, Literal["plain", "rope_q", "rope_kv", "experts"]]] = [
    (r"embed\.weight", "model.embed_tokens.weight", "plain"),
    (r"norm\.weight", "model.norm.weight", "plain"),
    (r"lm_head\.weight", "lm_head.weight", "plain"),
    (_LAYER + r"attn_norm\.weight", "input_layernorm.weight", "plain"),
    (_LAYER + r"ffn_norm\.weight", "post_attention_layernorm.weight", "plain"),
    (_LAYER + r"attn\.wq\.weight", "self_attn.q_proj.weight", "rope_q"),
    (_LAYER + r"attn\.wq_a\.weight", "self_attn.q_a_proj.weight", "plain"),
    (_LAYER + r"attn\.q_norm\.weight", "self_attn.q_a_layernorm.weight", "plain"),
    (_LAYER + r"attn\.wq_b\.weight", "self_attn.q_b_proj.weight", "rope_q"),
    (_LAYER + r"attn\.wkv_a\.weight", "self_attn.kv_a_proj_with_mqa.weight", "rope_kv"),
    (_LAYER + r"attn\.kv_norm\.weight", "self_attn.kv_a_layernorm.weight", "plain"),
    (_LAYER + r"attn\.wkv_b\.weight", "self_attn.kv_b_proj.weight", "plain"),
    (_LAYER + r"attn\.wg\.weight", "self_attn.g_proj.weight", "plain"),
    (_LAYER + r"attn\.wo\.weight", "self_attn.o_proj.weight", "plain"),
    (_LAYER + r"ffn\.w_(gate|up|down)\.weight", "mlp.{}_proj.weight", "plain"),
    (_LAYER + r"ffn\.router\.weight", "mlp.gate.weight", "plain"),
    (_LAYER + r"ffn\.router\.score_bias_E", "mlp.gate.e_score_correction_bias", "plain"),
    (_LAYER + r"ffn\.latent_(down|up)\.weight", "mlp.latent_{}_proj.weight", "plain"),
    (_LAYER + r"ffn\.latent_norm\.weight", "mlp.latent_norm.weight", "plain"),
    (_LAYER + r"ffn\.shared\.w_(gate|up|down)\.weight", "mlp.shared_experts.{}_proj.weight", "plain"),
    (_LAYER + r"ffn\.experts\.master\.(gate_up|down)", "mlp.experts.{{j}}.{{p}}_proj.weight", "experts"),
    (_LAYER + r"res_attn\.(query|key_norm\.weight)", "attn_res.{}", "plain"),
    (_LAYER + r"res_ffn\.(query|key_norm\.weight)", "mlp_res.{}", "plain"),
    (r"final_res\.query", "model.final_res.query", "plain"),
    (r"final_res\.key_norm\.weight", "model.final_res.key_norm.weight", "plain"),
]
_KDA_RULES: list[tuple[str, str, Literal["plain"]]] = [
    (_LAYER + r"attn\.((?:[qkvfbgo]|f_[ab]|g_[ab])_proj)\.weight", "self_attn.{}.weight", "plain"),
    (_LAYER + r"attn\.([qkv]_conv1d)", "self_attn.{}.weight", "plain"),
    (_LAYER + r"attn\.(A_log|dt_bias|o_norm\.weight)", "self_attn.{}", "plain"),
]
_COMPILED = [(re.compile(pattern), target, kind) for pattern, target, kind in _RULES]
_KDA_COMPILED = [(re.compile(pattern), target, kind) for pattern, target, kind in _KDA_RULES]
_LAYER_IDX = re.compile(_LAYER)
_EXPERT_PARTS = {"gate_up": ("gate", "up"), "down": ("down",)}  # HF projections in moontrain's column order


@dataclass(frozen=True, slots=True)
class HFName:
    """Where a moontrain tensor lives in an HF checkpoint. For experts, `name` holds `{j}` (the expert) and
    `{p}` (the HF projection), and `parts` the HF projections whose [out, in] weights, transposed, are the
    expert's equal column blocks in order (gate_up: gate then up)."""

    name: str
    kind: Literal["plain", "rope_q", "rope_kv", "experts"]
    parts: tuple[str, ...] = ()

    def experts(self, j: int) -> list[str]:
        """The HF names of expert j's column blocks, in column order."""
        return [self.name.format(j=j, p=p) for p in self.parts]


def hf_name(name: str, cfg: ModelConfig) -> HFName:
    """The HF name of moontrain tensor `name` (a canonical state-dict name, without the `model.` prefix)."""
    layer = _LAYER_IDX.match(name)
    kda = layer is not None and ".attn." in name and cfg.layer_is_kda(int(layer.group(1)))
    for pattern, target, kind in _KDA_COMPILED if kda else _COMPILED:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        groups = m.groups()
        if kind == "experts":
            return HFName(f"model.layers.{groups[0]}." + target.format(), kind, _EXPERT_PARTS[groups[1]])
        if name.startswith("layers."):
            return HFName(f"model.layers.{groups[0]}." + target.format(*groups[1:]), kind)
        return HFName(target, kind)
    raise CheckpointError(f"moontrain tensor {name!r} has no Hugging Face name: the HF format does not cover this "
                          "part of the architecture yet (moontrain/checkpoint/hf_names.py)")


def rope_rows(kind: str, cfg: ModelConfig, num_rows: int, *, to_hf: bool) -> torch.Tensor | None:
    """Row order that converts a rope_q / rope_kv weight between the two layouts (new = old[order]), or
    None when the rows stay where they are."""
    Dr = cfg.qk_rope_head_dim
    if kind not in ("rope_q", "rope_kv") or Dr == 0:
        return None
    perm = half_split_to_interleaved(Dr) if to_hf else interleaved_to_half_split(Dr)
    order = torch.arange(num_rows)
    if kind == "rope_kv":
        order[-Dr:] = order[-Dr:][perm]
        return order
    per_head = order.view(cfg.num_heads, cfg.qk_head_dim)
    per_head[:, -Dr:] = per_head[:, -Dr:][:, perm]
    return order
