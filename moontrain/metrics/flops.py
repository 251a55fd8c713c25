"""Model FLOPs per token and MFU.

FLOPs per token = 6 * (active parameters that take part in matmuls: all but the embedding lookup)
+ attention scores and values: 6 * layers * heads * (qk_head_dim + v_head_dim) * seq_len / 2 (causal)
+ AttnRes (model.attn_res_block_size): per aggregation over N values, 2DN for the scores and 2DN for
  the weighted sum, x3 for forward and backward (the RMS factors and the softmax are not counted, as
  norms are not). SiTU-GLU and SwiGLU count the same (elementwise, not matmul).
MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s).
"""

from __future__ import annotations

import torch

from moontrain.model.attn_res import aggregation_sizes
from moontrain.model.config import ModelConfig
from moontrain.planning.params import count_params

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    counts = count_params(cfg)
    # the embedding is a lookup; AttnRes parameters are counted below, per aggregation
    matmul_params = counts.active - cfg.vocab_size * cfg.hidden_size - counts.attn_res
    attn = 6 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2
    attn_res = 12 * cfg.hidden_size * sum(aggregation_sizes(cfg.num_layers, cfg.attn_res_block_size))
    return 6 * matmul_params + attn + attn_res


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
