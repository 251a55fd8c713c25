"""QK-Clip (Kimi K2): after each optimizer step, scale back the query/key weights of every attention head
whose maximum attention logit exceeded tau. Softmax (MLA) layers only: KDA layers have no logits.

Legend: L full-attention layers, N heads, Dn nope and Dr rope head dims, Dv value head dim.

Measurement (moontrain.model.max_logit): each MLA forward folds the exact causal maximum of scale * q.k
per head into the layer's running maximum; it covers every micro-batch of the step.

Clip, per layer and head h, with S_h the step's maximum over every rank's tokens (one all_reduce MAX)
and gamma_h = min(1, tau / S_h): in MLA the head-specific query and key parts are rescaled (Kimi K2),
the shared rope key is not:
    q_nope rows of head h (wq_b or wq)       *= sqrt(gamma_h)
    k_nope rows of head h (wkv_b)            *= sqrt(gamma_h)
    q_rope rows of head h (wq_b or wq)       *= gamma_h
so every logit of head h is scaled by exactly gamma_h and the step's maximum becomes tau. Value rows
and the optimizer state are untouched. FSDP shards are scaled on their local rows.

Metrics (identical on every rank, read at logging steps only): qk/max_logit/layer<i> (the window's
maximum before the clip), qk/clipped_heads/layer<i> (heads clipped, summed over the window's steps),
and their max / total.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    chunk = -(-n // world) if n else 0
    offset = min(rank * chunk, n)
    return offset, min(chunk, n - offset)


def _scale_rows_(weight: torch.Tensor, scale_n: torch.Tensor) -> None:
    """weight[i, :] *= scale_n[i] on the rows this rank holds (all of them unless an FSDP shard)."""
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        offset, rows = _rows_of(weight.shape[0], mesh.size(), mesh.get_local_rank())
        local = weight.to_local()
        local.mul_(scale_n[offset:offset + rows, None].to(local.dtype))
    else:
        weight.mul_(scale_n[:, None].to(weight.dtype))


class QKClip:
    """Owns the max-logit measurement of the given attention modules and the clip after each step.

    Each module must expose `max_logit_N` (None: not measuring; a tensor: the running maximum that its
    forward updates with moontrain.model.max_logit.causal_max_logit), `cfg` (ModelConfig) and its q (wq_b or wq) and wkv_b."""

    def __init__(self, attns: list[nn.Module], tau: float, *, group: dist.ProcessGroup | None,
                 layer_ids: list[int]) -> None:
        if tau <= 0:
            raise ValueError(f"QK-Clip needs tau > 0, got {tau}")
        self.attns, self.tau, self.group, self.layer_ids = attns, tau, group, layer_ids
        device = next(attns[0].parameters()).device if attns else torch.device("cpu")
        for attn in attns:  # the forwards fold their maxima into these tensors in place; step() resets them
            attn.max_logit_N = torch.full((attn.cfg.num_heads,), -math.inf, dtype=torch.float32, device=device)
        self._window_max_L = torch.full((len(attns),), -math.inf, device=device)
        self._window_clipped_L = torch.zeros(len(attns), device=device)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Collective (one all_reduce): clip every head above tau, restart the measurement; returns the
        step's max logit per layer and head [L, N] (before clipping)."""
        if not self.attns:
            return torch.zeros(0, 0)
        max_LN = torch.stack([attn.max_logit_N for attn in self.attns])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(max_LN, op=dist.ReduceOp.MAX, group=self.group)
        gamma_LN = torch.where(max_LN > self.tau, self.tau / max_LN, 1.0)
        for attn, gamma_N in zip(self.attns, gamma_LN, strict=True):
            self._clip_layer(attn, gamma_N)
            attn.max_logit_N.fill_(-math.inf)
        self._window_max_L = torch.maximum(self._window_max_L, max_LN.amax(dim=1))
        self._window_clipped_L += (gamma_LN < 1.0).sum(dim=1)
        return max_LN

    @staticmethod
    def _clip_layer(attn: nn.Module, gamma_N: torch.Tensor) -> None:
        cfg = attn.cfg
        Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        root_N = gamma_N.sqrt()
        q_scale_Nd = torch.cat([root_N[:, None].expand(-1, Dn), gamma_N[:, None].expand(-1, Dr)], dim=1)
        kv_scale_Nd = torch.cat([root_N[:, None].expand(-1, Dn), torch.ones_like(gamma_N)[:, None].expand(-1, Dv)],
                                dim=1)
        wq = attn.wq if cfg.q_lora_rank is None else attn.wq_b
        _scale_rows_(wq.weight, q_scale_Nd.reshape(-1))
        _scale_rows_(attn.wkv_b.weight, kv_scale_Nd.reshape(-1))

    def flush(self) -> dict[str, float]:
        """The window's metrics (one host read), then a new window starts."""
        if not self.attns:
            return {}
        values = torch.cat([self._window_max_L, self._window_clipped_L]).tolist()
        L = len(self.attns)
        out = {}
        for i, layer_id in enumerate(self.layer_ids):
            out[f"qk/max_logit/layer{layer_id}"] = values[i]
            out[f"qk/clipped_heads/layer{layer_id}"] = values[L + i]
        out["qk/max_logit/max"] = max(values[:L])
        out["qk/clipped_heads/total"] = sum(values[L:])
        self._window_max_L.fill_(-math.inf)
        self._window_clipped_L.zero_()
        return out
