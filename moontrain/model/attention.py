"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and Kimi K2/K3 style) through SDPA.

Legend: B batch, T sequence, D hidden, N heads, Cq q low rank, Ckv kv low rank,
Dn nope head dim, Dr rope head dim, Dv value head dim.

q = W_qb(RMSNorm(W_qa x)) (or a full-rank W_q), kv latent c = RMSNorm(first Ckv of W_kva x) expands to
per-head k_nope and v through W_kvb; the last Dr dims of W_kva x are one rope key shared by all heads.
With use_nope the rope dims are kept but never rotated (no positional encoding at all). With the
output gate, o = o * sigmoid(W_g x) per head and channel before W_o (gated attention). In the hybrid
K3 stack these layers are the gated NoPE MLA between the KDA layers (moontrain.model.kda.layer).
SDPA gets q/k and v at their own head dims (cuDNN and memory-efficient attention accept Dv != Dn + Dr);
with kernels.attn_pad_head_dims they are zero-padded to one head dim (flash attention wants equal dims;
zero padding changes neither scores nor values) and the padding is sliced off the output.
While `max_logit_N` is a tensor (QK-Clip on: moontrain.optim.qk_clip owns it), each forward folds the
exact per-head maximum logit of its q and k into it (a separate no-grad pass; SDPA does not return it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moontrain.model.config import ModelConfig
from moontrain.model.documents import DocumentMask, causal_attention
from moontrain.model.max_logit import causal_max_logit
from moontrain.model.norm import RMSNorm
from moontrain.model.rope import apply_rope, softmax_scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, pad_head_dims: bool = False, device: torch.device | str | None = None
                 ) -> None:
        super().__init__()
        self.cfg = cfg
        self.pad_head_dims = pad_head_dims  # kernels.attn_pad_head_dims (see the module docstring)
        D, N = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(D, N * cfg.qk_head_dim, bias=False, device=device)
        else:
            self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False, device=device)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.mla_eps, device=device)
            self.wq_b = nn.Linear(cfg.q_lora_rank, N * cfg.qk_head_dim, bias=False, device=device)
        self.wkv_a = nn.Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, device=device)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.mla_eps, device=device)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False,
                               device=device)
        if cfg.attn_output_gate:
            self.wg = nn.Linear(D, N * cfg.v_head_dim, bias=False, device=device)
        self.wo = nn.Linear(N * cfg.v_head_dim, D, bias=False, device=device)
        self.max_logit_N: torch.Tensor | None = None  # QK-Clip's running max logit per head, or None

    def head_row_blocks(self) -> dict[str, tuple[int, ...]]:
        """Per-head Muon (optim.muon_per_head_qkv): parameter name -> the row sizes of its per-head
        matrices (the query: Dn + Dr rows per head; wkv_b: Dn key rows then Dv value rows per head)."""
        cfg = self.cfg
        N, Dn, Dr, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = "wq.weight" if cfg.q_lora_rank is None else "wq_b.weight"
        return {q: (Dn + Dr,) * N, "wkv_b.weight": (Dn, Dv) * N}

    def forward(self, x_BTD: torch.Tensor, cos_TDr: torch.Tensor, sin_TDr: torch.Tensor,
                docs: DocumentMask | None = None) -> torch.Tensor:
        """docs: packed documents; a query attends only to its own document (moontrain.model.documents)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        N, Dn, Dr, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            q = self.wq(x_BTD)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x_BTD)))
        q_BNTd = q.view(B, T, N, Dn + Dr).transpose(1, 2)
        kv = self.wkv_a(x_BTD)
        c_BTC, k_rope_BTDr = kv.split([cfg.kv_lora_rank, Dr], dim=-1)
        kv_BNTd = self.wkv_b(self.kv_norm(c_BTC)).view(B, T, N, Dn + Dv).transpose(1, 2)
        k_nope_BNTDn, v_BNTDv = kv_BNTd.split([Dn, Dv], dim=-1)
        k_rope_BNTDr = k_rope_BTDr.unsqueeze(1)
        if Dr and not cfg.use_nope:
            q_nope, q_rope = q_BNTd.split([Dn, Dr], dim=-1)
            q_BNTd = torch.cat([q_nope, apply_rope(q_rope, cos_TDr, sin_TDr)], dim=-1)
            k_rope_BNTDr = apply_rope(k_rope_BNTDr, cos_TDr, sin_TDr)
        k_BNTd = torch.cat([k_nope_BNTDn, k_rope_BNTDr.expand(B, N, T, Dr)], dim=-1)
        # its own storage: a view would keep wkv_b's whole output ([T, N, Dn + Dv]) alive until backward
        v_BNTd = v_BNTDv.contiguous()
        if self.max_logit_N is not None:  # in place: one tensor for the run (no recompiles under compile)
            self.max_logit_N.copy_(torch.maximum(self.max_logit_N, causal_max_logit(
                q_BNTd, k_BNTd, softmax_scale(cfg), None if docs is None else docs.id_BT)))
        if self.pad_head_dims and Dn + Dr != Dv:
            d = max(Dn + Dr, Dv)
            q_BNTd, k_BNTd = F.pad(q_BNTd, (0, d - Dn - Dr)), F.pad(k_BNTd, (0, d - Dn - Dr))
            v_BNTd = F.pad(v_BNTDv, (0, d - Dv))
        o_BNTd = causal_attention(q_BNTd, k_BNTd, v_BNTd, scale=softmax_scale(cfg), docs=docs)
        o_BTNDv = o_BNTd[..., :Dv].transpose(1, 2).reshape(B, T, N * Dv)
        if cfg.attn_output_gate:
            o_BTNDv = o_BTNDv * torch.sigmoid(self.wg(x_BTD))
        return self.wo(o_BTNDv)
