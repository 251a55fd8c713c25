"""Held-out loss and perplexity of a model on a document file (`moontrain eval`).

The rows are those the trainer's evaluation (moontrain/trainer/evaluate.py) reads: the held-out documents
packed in file order as one stream (back to back with EOS, rows of T + 1 tokens with stride T), the first
batches x batch_size of them. The loss is the per-token cross-entropy summed in float64 over all rows,
divided by their tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moontrain.data.config import SourceConfig
from moontrain.data.documents import open_documents
from moontrain.data.packed import PackedStream
from moontrain.data.tokenizer import ByteTokenizer, HFTokenizer
from moontrain.model.transformer import K3Model


@dataclass(frozen=True, slots=True)
class EvalResult:
    loss: float  # mean token cross-entropy (nats)
    perplexity: float
    tokens: int


@torch.no_grad()
def evaluate(model: K3Model, tokenizer: ByteTokenizer | HFTokenizer, data: SourceConfig, *, seq_len: int,
             batch_size: int, num_batches: int) -> EvalResult:
    if seq_len < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(f"seq_len, batch_size and num_batches must be >= 1, got {seq_len}, {batch_size}, {num_batches}")
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {model.cfg.vocab_size}")
    stream = PackedStream(open_documents(data, streaming=False, seq_len=seq_len), tokenizer, name="eval", index=0,
                          seed=0, shuffle=False, vocab_size=model.cfg.vocab_size, seq_len=seq_len, rank=0, world_size=1)
    device = model.embed.weight.device
    rows_nBT1 = torch.from_numpy(stream.rows(num_batches * batch_size)).view(num_batches, batch_size, seq_len + 1)
    routers = [moe.router for moe in model.moe_layers()]
    for r in routers:  # evaluation leaves the expert-bias statistics alone
        r.count_tokens = False
    ce_sum = 0.0
    try:
        for rows_BT1 in rows_nBT1.to(device):
            _, ce = model(rows_BT1[:, :-1], rows_BT1[:, 1:])
            ce_sum += ce.double().item() * batch_size * seq_len
    finally:
        for r in routers:
            r.count_tokens = True
    tokens = num_batches * batch_size * seq_len
    loss = ce_sum / tokens
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=tokens)
