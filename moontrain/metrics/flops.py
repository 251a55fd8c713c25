"""Model FLOPs per token and MFU.

FLOPs per token = 6 * (active parameters that take part in matmuls: all but the embedding lookup; the few
elementwise ones, norms and KDA's A_log / dt_bias, counted alike) + the sequence mixing beyond them:
- MLA layer: attention scores and values, 6 * heads * (qk_head_dim + v_head_dim) * seq_len / 2 (causal).
- KDA layer: the chunked recurrence (moontrain.model.kda.ops, chunk L = 64, key/value head dim K = V),
  forward per token and head: the intra-chunk products q.k and k.k with the decay (2 * K * L/2 each), the
  two triangular solves (V * L and K * L), P U (V * L), and the state's read, correction and update
  (3 * 2 * K * V); backward twice that: 3 * (L * (3K + 2V) + 6 K V). Linear in seq_len: at K = 128 a KDA
  head costs 0.42 MFLOP per token against 3.9 MFLOP for an MLA head (192/128) at seq_len 4096.
+ AttnRes (model.attn_res_block_size): per aggregation over N values, 2DN for the scores and 2DN for
  the weighted sum, x3 for forward and backward (the RMS factors and the softmax are not counted, as
  norms are not). SiTU-GLU and SwiGLU count the same (elementwise, not matmul).
MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s).
"""

from __future__ import annotations

import torch

from moontrain.model.attn_res import aggregation_sizes
from moontrain.model.config import ModelConfig
from moontrain.model.kda.ops import CHUNK as KDA_CHUNK
from moontrain.model.params import count_params

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def mla_mixing_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """One MLA layer's attention (scores and values), forward and backward."""
    return 6 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2


def kda_mixing_flops_per_token(cfg: ModelConfig) -> float:
    """One KDA layer's chunked recurrence, forward and backward."""
    K = V = cfg.kda_head_dim
    return 3 * cfg.kda_heads * (KDA_CHUNK * (3 * K + 2 * V) + 6 * K * V)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    counts = count_params(cfg)
    # the embedding is a lookup; AttnRes parameters are counted below, per aggregation
    matmul_params = counts.active - cfg.vocab_size * cfg.hidden_size - counts.attn_res
    mixing = (cfg.num_mla_layers * mla_mixing_flops_per_token(cfg, seq_len)
              + cfg.num_kda_layers * kda_mixing_flops_per_token(cfg))
    attn_res = 12 * cfg.hidden_size * sum(aggregation_sizes(cfg.num_layers, cfg.attn_res_block_size))
    return 6 * matmul_params + mixing + attn_res


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
