"""What a training pass keeps for backward, per token and per transformer layer (a rough model, shapes only), and
which layers activation checkpointing recomputes (train.activation_checkpointing).

Per layer, without recomputation, the tensors saved for backward per token: the compute dtype for most, fp32
for routing weights (~30 % rough; the routed experts keep h, u and a weight per row). The sequence mixing: MLA
(its projections, the attention's inputs and output) or KDA (fla's kernel: the projections before and after
the short convolutions, gate, output, fp32 decays, the chunk's two L x L matrices per head and the
chunk-boundary states, K x V per head per L tokens); the FFN: the dense one or the MoE (latent projection,
routed rows, shared experts; SiTU-GLU saves what SwiGLU saves, the gate and up outputs); AttnRes
(model.attn_res_block_size): each aggregation keeps two fp32 values per token per value it attends over (its
rsqrt factors and weights), and each layer its two partial sums besides the norms' inputs. Beside the layers:
the final aggregation and the saved grad of the head's input (D per token).

A recomputed layer (torch.utils.checkpoint around the block) keeps its input (D per token; the completed
AttnRes blocks are earlier layers' tensors, counted there) and, while its backward runs, its full activations
again. The peak is the larger of two moments: the forward's end (every kept layer, the recomputed layers'
inputs, the head's and the loss's transients) and a layer's backward (its activations whole beside the kept
layers before it: the later ones are freed by then). Measured on an H100 (k3_small's recipe batch, bf16
moments; docs/performance.md): 41.9 / 53.8 / 56.1 / 58.4 / 75.1 GiB allocated at the peak with 16 / 9 / 8 / 7 /
0 layers recomputed (the last on an H200), where the estimate outside the symmetric heap says 42.2 / 55.2 / 57.4 /
59.6 / 75.4 (the pass's dense grads, which exist only in backward, counted there: moontrain.planning.memory).

Which layers: train.activation_checkpointing = true recomputes every layer, false none, an integer n the n
layers that free the most memory (the largest saved bytes first: at k3_small the KDA layers, 151 KB a token
against the MLA layers' 120 KB; ties in layer order), and "auto" the fewest of that order whose estimate fits
the GPU (moontrain.planning.memory.fit_recompute, resolved at launch). Recomputing costs one more forward of
each recomputed layer, so n layers cost n / num_layers of a full recomputation's extra time.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from moontrain.config.run_config import RunConfig
from moontrain.model.attn_res import aggregation_sizes
from moontrain.model.kda.ops import CHUNK as KDA_CHUNK


@dataclass(frozen=True, slots=True)
class LayerActivations:
    """Bytes per token one transformer layer keeps for backward without recomputation, by part."""

    mixing: float  # MLA or KDA
    ffn: float  # dense FFN or MoE
    attn_res: float  # its two aggregations and two partial sums (0 without AttnRes)

    @property
    def total(self) -> float:
        return self.mixing + self.ffn + self.attn_res


def layer_activations(cfg: RunConfig, c: int) -> list[LayerActivations]:
    """Per transformer layer, in order; c: bytes of the compute dtype."""
    m = cfg.model
    D, N, K = m.hidden_size, m.num_heads, m.num_experts_per_tok
    qk, dv = m.qk_head_dim, m.v_head_dim
    q_low = 2 * m.q_lora_rank if m.q_lora_rank is not None else 0
    attn = (2 * D + q_low + N * qk + (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            + N * (m.qk_nope_head_dim + dv) + 2 * N * qk + 4 * N * dv) * c
    dense_ffn = (2 * D + 2 * m.dense_intermediate_size) * c
    H, F = m.expert_width, m.moe_intermediate_size
    latent = 2 * H + D if m.moe_latent_size is not None else 0
    rows = K * cfg.parallel.ep_hosts  # hierarchical EP: the host stage's static rows (moontrain.planning.memory)
    routed = rows * 2 * F * c + rows * 4 + m.num_experts * 8  # h, u and the route weight per row (moonep.expert_glu)
    shared = (2 * m.num_shared_experts * F + D) * c  # h, u (moontrain.model.ffn recomputes the activation)
    moe = (2 * D + latent) * c + routed + shared
    HK, L = m.kda_heads * m.kda_head_dim, KDA_CHUNK
    kda = (2 * D + 11 * HK + m.kda_head_dim * HK // L) * c + (2 * HK + 2 * L * m.kda_heads) * 4
    sizes = aggregation_sizes(m.num_layers, m.attn_res_block_size)
    return [LayerActivations(mixing=kda if m.layer_is_kda(i) else attn,
                             ffn=dense_ffn if i < m.num_dense_layers else moe,
                             attn_res=8 * (sizes[2 * i] + sizes[2 * i + 1]) + 2 * D * c if sizes else 0.0)
            for i in range(m.num_layers)]


def recompute_order(cfg: RunConfig, c: int) -> list[int]:
    """The layers by the memory their recomputation frees, largest first (ties in layer order)."""
    kept = [layer.total for layer in layer_activations(cfg, c)]
    return sorted(range(len(kept)), key=lambda i: (-kept[i], i))


def configured_recompute(cfg: RunConfig, c: int) -> tuple[int, ...] | None:
    """The recomputed layers train.activation_checkpointing names (ascending), None for "auto" (resolved against
    the GPU's memory at launch: moontrain.planning.memory.fit_recompute)."""
    setting, L = cfg.train.activation_checkpointing, cfg.model.num_layers
    if setting == "auto":
        return None
    if setting is True or setting is False:
        return tuple(range(L)) if setting else ()
    return tuple(sorted(recompute_order(cfg, c)[:setting]))


def describe_recompute(cfg: RunConfig, layers: Collection[int]) -> str:
    """The recomputed layers in words (the launch output, the dry run)."""
    L = cfg.model.num_layers
    if not layers:
        return "no layer recomputed"
    if len(layers) == L:
        return "every layer recomputed"
    return f"{len(layers)} of {L} layers recomputed ({', '.join(map(str, sorted(layers)))})"


def activation_bytes(cfg: RunConfig, c: int, recomputed: Collection[int], tokens: int, head_loss: float,
                     backward: float = 0.0) -> float:
    """The most the pass holds for backward at once, in bytes, with `recomputed` layers checkpointed, at `tokens`
    tokens a pass (head_loss: the head's and the loss's own bytes at the forward's end, which the head's backward,
    the first to run, frees; backward: bytes that exist only while the backward runs, e.g. the pass's dense
    grads). Two moments can hold the most (the module docstring): the forward's end, every kept layer and every
    recomputed layer's input beside head_loss; or a layer's backward, its activations whole (kept, or recomputed
    just now) beside the kept layers before it, the recomputed inputs up to it and `backward`."""
    m = cfg.model
    D = m.hidden_size
    layers = layer_activations(cfg, c)
    sizes = aggregation_sizes(m.num_layers, m.attn_res_block_size)
    outside = (8 * sizes[-1] if sizes else 0) + D * c  # the final aggregation; the saved grad of the head's input
    inputs = [D * c if i in recomputed else 0 for i in range(len(layers))]
    kept = [0.0 if i in recomputed else layer.total for i, layer in enumerate(layers)]
    forward_end = tokens * (sum(kept) + sum(inputs) + outside) + head_loss
    in_backward = max(tokens * (sum(kept[:i]) + layers[i].total + sum(inputs[:i + 1]) + outside)
                      for i in range(len(layers))) if layers else 0.0
    return max(forward_end, in_backward + backward)
