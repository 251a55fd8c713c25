"""Incremental forward of a K3Model with a DecodeCache, and sampling.

Legend: B batch, T new tokens, S positions so far (cached + new), N heads, C kv latent width,
Dn/Dr/Dv nope/rope/value head dims, D hidden, V vocab.

The blocks' own modules (norms, projections, dense FFN, MoE with its router and the local experts
backend) run unchanged; only attention is re-expressed to read keys and values from the cache: the
new tokens' normed kv latent and rotated rope key are appended, and k_nope / v of every position are
expanded from the cached latents through W_kvb. With an empty cache and the whole sequence this is the
training forward's math (tests/moontrain/generate/test_generate.py checks greedy decoding token for token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moontrain.generate.cache import DecodeCache, KDACache, MLACache
from moontrain.model.attention import MLAttention
from moontrain.model.documents import document_ids
from moontrain.model.kda.layer import KimiDeltaAttention
from moontrain.model.kda.ops import chunk_kda_with_state, kda_gate, l2_normalize
from moontrain.model.kda.short_conv import short_conv
from moontrain.model.rope import apply_rope, rope_cos_sin, softmax_scale
from moontrain.model.transformer import K3Model


def new_cache(model: K3Model, batch: int, max_len: int) -> DecodeCache:
    cfg = model.cfg
    layers = []
    for block in model.layers:
        if isinstance(block.attn, KimiDeltaAttention):
            layers.append(KDACache(batch, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size,
                                   dtype=block.attn.q_proj.weight.dtype, device=block.attn.q_proj.weight.device))
            continue
        if not isinstance(block.attn, MLAttention):
            raise ValueError(f"decoding does not support attention layers of type {type(block.attn).__name__} yet")
        layers.append(MLACache(batch, max_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                               dtype=block.attn.wkv_a.weight.dtype, device=block.attn.wkv_a.weight.device))
    return DecodeCache(layers)


def _attend(attn: MLAttention, x_BTD: torch.Tensor, cache: MLACache, start: int,
            doc_id_BS: torch.Tensor | None = None) -> torch.Tensor:
    cfg = attn.cfg
    B, T, _ = x_BTD.shape
    N, Dn, Dr, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = attn.wq(x_BTD) if cfg.q_lora_rank is None else attn.wq_b(attn.q_norm(attn.wq_a(x_BTD)))
    q_BNTd = q.view(B, T, N, Dn + Dr).transpose(1, 2)
    c_BTC, k_rope_BTDr = attn.wkv_a(x_BTD).split([cfg.kv_lora_rank, Dr], dim=-1)
    c_BTC = attn.kv_norm(c_BTC)
    if Dr and not cfg.use_nope:
        cos, sin = rope_cos_sin(T, Dr, cfg.rope_theta, x_BTD.device, yarn=cfg.rope_yarn, start=start)
        q_nope, q_rope = q_BNTd.split([Dn, Dr], dim=-1)
        q_BNTd = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k_rope_BTDr = apply_rope(k_rope_BTDr, cos, sin)
    c_BSC, k_rope_BSDr = cache.append(c_BTC, k_rope_BTDr)
    S = c_BSC.shape[1]
    k_nope_BNSDn, v_BNSDv = attn.wkv_b(c_BSC).view(B, S, N, Dn + Dv).transpose(1, 2).split([Dn, Dv], dim=-1)
    k_BNSd = torch.cat([k_nope_BNSDn, k_rope_BSDr.unsqueeze(1).expand(B, N, S, Dr)], dim=-1)
    if S == T and doc_id_BS is None:
        o_BNTDv = F.scaled_dot_product_attention(q_BNTd, k_BNSd, v_BNSDv, is_causal=True, scale=softmax_scale(cfg))
    else:  # query i sits at position start + i and sees keys 0 .. start + i (of its own document)
        mask_TS = torch.arange(S, device=x_BTD.device) <= torch.arange(start, start + T, device=x_BTD.device)[:, None]
        if doc_id_BS is not None:
            mask_TS = (mask_TS & (doc_id_BS[:, start:, None] == doc_id_BS[:, None, :])).unsqueeze(1)
        o_BNTDv = F.scaled_dot_product_attention(q_BNTd, k_BNSd, v_BNSDv, attn_mask=mask_TS, scale=softmax_scale(cfg))
    o_BTNDv = o_BNTDv.transpose(1, 2).reshape(B, T, N * Dv)
    if cfg.attn_output_gate:
        o_BTNDv = o_BTNDv * torch.sigmoid(attn.wg(x_BTD))
    return attn.wo(o_BTNDv)


def _attend_kda(attn: KimiDeltaAttention, x_BTD: torch.Tensor, cache: KDACache, start: int,
                docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """KimiDeltaAttention.forward continued from the cached convolution tails and recurrent state (the
    pure-PyTorch recurrence, chunked over the new tokens). docs: (start_BS, id_BS) of every position."""
    cfg = attn.cfg
    B, T, _ = x_BTD.shape
    H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
    doc_start_BT = conv_id_BT = None
    if docs is not None:  # the tails' positions before the sequence hold zeros: any document id will do
        doc_start_BT, conv_id_BT = docs[0][:, start:], F.pad(docs[1], (W - 1, 0))[:, start:]
    q_in, k_in, v_in, f_in, g_in, b_in = attn.project(x_BTD)
    qkv = [short_conv(cache.extend(i, x_in), w, conv_id_BT)[:, -T:].reshape(B, T, H, K)
           for i, (x_in, w) in enumerate(((q_in, attn.q_conv1d), (k_in, attn.k_conv1d), (v_in, attn.v_conv1d)))]
    g = kda_gate(attn.forget(f_in).view(B, T, H, K), attn.A_log, attn.dt_bias, cfg.kda_gate_lower_bound)
    beta = torch.sigmoid(b_in.float())
    o_BTHK, cache.state_BHKV = chunk_kda_with_state(l2_normalize(qkv[0]), l2_normalize(qkv[1]), qkv[2], g, beta,
                                                    scale=K ** -0.5, doc_start_BT=doc_start_BT,
                                                    initial_state_BHKV=cache.state_BHKV)
    o_BTHK = attn.o_norm(o_BTHK, attn.output_gate(g_in).view(B, T, H, K))
    return attn.o_proj(o_BTHK.reshape(B, T, H * K))


def _attend_any(attn: MLAttention | KimiDeltaAttention, x_BTD: torch.Tensor, cache: MLACache | KDACache,
                start: int, docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    if isinstance(attn, KimiDeltaAttention):
        return _attend_kda(attn, x_BTD, cache, start, docs)
    return _attend(attn, x_BTD, cache, start, docs[1] if docs is not None else None)


@torch.no_grad()
def forward_cached(model: K3Model, tokens_BT: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
    """Logits [B, T, V] of the new tokens, which sit at positions cache.start ..; the cache advances."""
    cache.tokens_BS = tokens_BT if cache.tokens_BS is None else torch.cat([cache.tokens_BS, tokens_BT], dim=1)
    # packed documents as in the training forward: a token after an EOS sees nothing before it
    eos = model.document_eos_id
    docs = document_ids(cache.tokens_BS, eos) if eos is not None else None
    x_BTD = model.embed(tokens_BT)
    blocks: tuple[torch.Tensor, ...] = ()  # AttnRes: completed blocks are per token, nothing to cache
    for block, state in zip(model.layers, cache.layers, strict=True):
        blocks, x_BTD, _ = block.residuals(
            blocks, x_BTD, lambda h_BTD, attn=block.attn, state=state: _attend_any(attn, h_BTD, state, cache.start, docs))
    if model.final_res is not None:
        x_BTD = model.final_res(blocks, x_BTD)
    cache.start += tokens_BT.shape[1]
    return model.lm_head(model.norm(x_BTD))


def sample(logits_BV: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None
           ) -> torch.Tensor:
    """Next token ids [B]: argmax at temperature 0, else a draw from the top-p nucleus of softmax(logits / T)."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    sorted_BV, order_BV = probs_BV.sort(-1, descending=True)
    outside = sorted_BV.cumsum(-1) - sorted_BV >= top_p  # keep the smallest prefix whose mass reaches top_p
    sorted_BV = sorted_BV.masked_fill(outside, 0.0)
    pick_B1 = torch.multinomial(sorted_BV, 1, generator=generator)
    return order_BV.gather(-1, pick_B1).squeeze(-1)


@torch.no_grad()
def generate(model: K3Model, prompt_BT: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """Prompt followed by up to max_new_tokens tokens [B, T + n] (stops early when every row has emitted
    eos_id). use_cache=False re-runs the training forward over the whole sequence at every step."""
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 0; got {temperature}, "
                         f"{top_p}, {max_new_tokens}")
    gen = torch.Generator(device=prompt_BT.device)
    gen.manual_seed(seed)
    B, T = prompt_BT.shape
    cache = new_cache(model, B, T + max_new_tokens) if use_cache else None
    seq_BT, step_in = prompt_BT, prompt_BT
    done_B = torch.zeros(B, dtype=torch.bool, device=prompt_BT.device)
    for _ in range(max_new_tokens):
        logits_BTV = forward_cached(model, step_in, cache) if cache is not None else model.logits(seq_BT)
        next_B = sample(logits_BTV[:, -1], temperature=temperature, top_p=top_p, generator=gen)
        if eos_id is not None:
            next_B = torch.where(done_B, torch.full_like(next_B, eos_id), next_B)
            done_B |= next_B == eos_id
        seq_BT = torch.cat([seq_BT, next_B[:, None]], dim=1)
        step_in = next_B[:, None]
        if eos_id is not None and bool(done_B.all()):
            break
    return seq_BT
