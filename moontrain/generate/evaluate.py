"""Held-out loss and perplexity of a model on a document file (`moontrain eval`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moontrain.data.config import DataConfig
from moontrain.data.source import build_token_source
from moontrain.model.transformer import K3Model


@dataclass(frozen=True, slots=True)
class EvalResult:
    loss: float  # mean token cross-entropy (nats)
    perplexity: float
    tokens: int


@torch.no_grad()
def evaluate(model: K3Model, data: DataConfig, *, seq_len: int, batch_size: int, num_batches: int) -> EvalResult:
    """Mean cross-entropy over the first num_batches packed batches of `data` (file order, no shuffle)."""
    if seq_len < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(f"seq_len, batch_size and num_batches must be >= 1, got {seq_len}, {batch_size}, {num_batches}")
    device = model.embed.weight.device
    source = build_token_source(data, vocab_size=model.cfg.vocab_size, seq_len=seq_len, global_batch=batch_size,
                                rank=0, world_size=1)
    total = 0.0
    for step in range(num_batches):
        tokens_BT, targets_BT = (t.to(device) for t in source.batch(step))  # sources give CPU batches
        total += model(tokens_BT, targets_BT)[1].item()
    loss = total / num_batches
    return EvalResult(loss=loss, perplexity=math.exp(loss), tokens=num_batches * batch_size * seq_len)
