"""Per-rank memory estimate for a training layout, computed from shapes only (nothing is allocated).

Legend: W world, R = ep, epn = E/R, B = epn prefetch slots (training), S tokens per rank per step,
K top-k, H expert width, F expert FFN width, D hidden, L_moe MoE layers.

Terms (bytes per rank):
- dense params (FSDP over W): fp32 master 4P/W, fp32 grad shard 4P/W, Adam 8P/W; the gathered compute
  copy of the root (embedding, head) plus two blocks (current + prefetched), in the compute dtype.
- expert local rows (L_moe * epn * 3*H*F): compute weights (bf16; in the symmetric heap for moonep),
  fp32 master, fp32 grad (moonep: the grad mirror, also in the heap), Adam 8 bytes/param.
- symmetric heap extra (moonep): per projection B slot rows (compute dtype) and B reduce-buffer rows
  (fp32), shared by all layers; plus the receive buffer NvS x H (NvS = S*K + 2*epn*token_padding).
- alltoall receive buffers are dynamic: S*K*H at balance, up to R times that under full skew.
- activations: tensors saved for backward per token per layer (no recomputation), the compute dtype
  for most, fp32 for routing weights, the K-way combine and the logits (a rough model, within ~30%).
"""

from __future__ import annotations

from dataclasses import dataclass

from moontrain.config.run_config import RunConfig
from moontrain.planning.params import ParamCounts


@dataclass(kw_only=True, slots=True)
class MemoryEstimate:
    dense_compute: float
    dense_master: float
    dense_grads: float
    dense_optimizer: float
    expert_compute: float
    expert_master: float
    expert_grads: float
    expert_optimizer: float
    heap_extra: float  # moonep slot pools + reduce buffers
    receive_buffers: float
    activations: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f) for f in self.__slots__)

    def rows(self) -> list[tuple[str, float]]:
        return [(f, getattr(self, f)) for f in self.__slots__] + [("total", self.total)]


def estimate_memory(cfg: RunConfig, counts: ParamCounts, world_size: int, compute_bytes: int) -> MemoryEstimate:
    m, R = cfg.model, cfg.parallel.ep
    epn = m.num_experts // R
    H, F, K = m.expert_width, m.moe_intermediate_size, m.num_experts_per_tok
    S = cfg.train.global_batch_size // world_size * cfg.train.seq_len
    expert_local = m.num_moe_layers * epn * 3 * H * F
    P = counts.dense
    gathered = counts.embedding + 2 * counts.max_block_dense(m)
    moonep = cfg.experts.backend == "moonep"
    slots = epn if moonep else 0
    nvs = S * K + 2 * epn * cfg.experts.token_padding
    receive = nvs * H * compute_bytes if moonep else S * K * H * compute_bytes
    return MemoryEstimate(
        dense_compute=gathered * compute_bytes,
        dense_master=4 * P / world_size,
        dense_grads=4 * P / world_size + gathered * compute_bytes,
        dense_optimizer=8 * P / world_size,
        expert_compute=expert_local * compute_bytes,
        expert_master=4 * expert_local,
        expert_grads=4 * expert_local,
        expert_optimizer=8 * expert_local,
        heap_extra=slots * 3 * H * F * (compute_bytes + 4),
        receive_buffers=receive,
        activations=S * _activation_bytes_per_token(cfg, compute_bytes),
    )


def _activation_bytes_per_token(cfg: RunConfig, c: int) -> float:
    m = cfg.model
    D, N, K = m.hidden_size, m.num_heads, m.num_experts_per_tok
    qk, dv = m.qk_head_dim, m.v_head_dim
    q_low = 2 * m.q_lora_rank if m.q_lora_rank is not None else 0
    attn = (2 * D + q_low + N * qk + (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            + N * (m.qk_nope_head_dim + dv) + 2 * N * qk + 4 * N * dv) * c
    dense_ffn = (2 * D + 3 * m.dense_intermediate_size) * c
    H, F = m.expert_width, m.moe_intermediate_size
    latent = 2 * H + D if m.moe_latent_size is not None else 0
    routed = K * (2 * H + 3 * F) * c + K * H * 4 + m.num_experts * 8
    shared = (3 * m.num_shared_experts * F + D) * c
    moe = (2 * D + latent) * c + routed + shared
    logits = cfg.model.vocab_size * (c + 8)
    return m.num_dense_layers * (attn + dense_ffn) + m.num_moe_layers * (attn + moe) + logits
