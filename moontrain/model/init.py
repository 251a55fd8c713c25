"""Parameter initialisation: the std each parameter is drawn with, and why (docs/learning.md, "Init").

Legend: D hidden, L layers, l a layer's index (0-based), s = init_std (model.init_std, 0.02).

A pre-norm residual stream must start dominated by the token embedding: every sublayer reads the
RMS-normalised stream, so whatever is largest in it is what the attention, the FFN and the router
see. The scheme keeps that hierarchy at any width and depth:

- token embedding: N(0, model.init_embed_std^2) (1.0: unit-RMS rows, as torchtitan and nn.Embedding);
- every projection that reads the normed stream or a latent (q/kv/gate/up, KDA's q/k/v/f/g/b, the
  latent down projection, the experts' gate and up): N(0, s^2);
- every projection that writes into the residual stream (MLA's wo, KDA's o_proj, the dense and
  shared FFNs' w_down, the latent MoE's latent_up, or the experts' down without a latent), and the
  router: N(0, (s / sqrt(2 (l + 1)))^2), torchtitan's depth scaling, so a layer adds little to the
  stream at init and deeper layers add less;
- LM head: N(0, 1 / D), unit-variance logits from the unit-RMS final norm;
- norms 1, AttnRes pseudo-queries 0 (uniform depth weights), KDA's decay, gate and conv taps its own
  (KimiDeltaAttention.init_parameters), router bias 0.

Measured: with every matrix and the embedding at s (the previous scheme) the embedding's RMS was
0.02 against ~0.3 for the first attention output, a context average nearly the same for every token;
at D = 2048 the first MoE layer routed every token of a text sequence to the same few experts before
any step (expert maxvio 5.8 of a possible 11), and training settled at the unigram loss.

Draws are deterministic and independent of the parallel layout: dense parameters come from one
seeded stream in parameter order, experts from per-expert generators (ExpertWeights.init_master).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moontrain.model.config import ModelConfig

# parameters (by name suffix) that write a layer's output into the residual stream
_RESIDUAL_WRITERS = ("attn.wo.weight", "attn.o_proj.weight", "ffn.w_down.weight", "ffn.shared.w_down.weight",
                     "ffn.latent_up.weight", "ffn.router.weight")


def depth_std(cfg: ModelConfig, layer_idx: int) -> float:
    """The std of layer `layer_idx`'s residual writers and router: s / sqrt(2 (l + 1))."""
    return cfg.init_std / math.sqrt(2 * (layer_idx + 1))


def dense_std(name: str, cfg: ModelConfig) -> float | None:
    """The normal std of dense parameter `name`, or None where the parameter is set otherwise (norms,
    AttnRes queries, KDA's own parameters)."""
    if name == "embed.weight":
        return cfg.init_embed_std
    if name == "lm_head.weight":
        return cfg.hidden_size ** -0.5
    if name.endswith("norm.weight") or name.endswith(".query"):
        return None
    if name.endswith((".A_log", ".dt_bias", "_conv1d")):
        return None
    if name.startswith("layers.") and name.endswith(_RESIDUAL_WRITERS):
        return depth_std(cfg, int(name.split(".")[1]))
    return cfg.init_std


@torch.no_grad()
def init_dense(model: nn.Module, cfg: ModelConfig, gen: torch.Generator) -> None:
    """Every dense (non-expert) parameter of a K3Model, in parameter order from `gen`."""
    for name, p in model.named_parameters():
        if ".experts.master." in name:
            continue
        std = dense_std(name, cfg)
        if std is not None:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".query"):
            p.zero_()


def expert_stds(cfg: ModelConfig, layer_idx: int) -> dict[str, float]:
    """Per expert projection: gate and up read the (latent) input at s; down writes into the residual
    stream (depth-scaled) unless the latent MoE's latent_up does (then down is an inner projection)."""
    down = cfg.init_std if cfg.moe_latent_size is not None else depth_std(cfg, layer_idx)
    return {"gate": cfg.init_std, "up": cfg.init_std, "down": down}
