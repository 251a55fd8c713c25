"""Held-out loss and perplexity of a model on a document file (`moontrain eval`).

The held-out documents are packed in file order as one stream (back to back with EOS, as the trainer's
evaluation packs them, moontrain/trainer/evaluate.py) and every token of it is a target exactly once:
rows of T + 1 tokens with stride T, and a last, shorter row for the remainder. `num_batches` takes only the
first batches x batch_size full rows instead; asking for more rows than the file holds is refused rather
than read around again. The loss is the per-token cross-entropy summed in float64 over the rows, divided
by their targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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
    tokens: int  # targets evaluated
    available: int  # targets the file holds (each evaluated once when tokens == available)


@torch.no_grad()
def evaluate(model: K3Model, tokenizer: ByteTokenizer | HFTokenizer, data: SourceConfig, *, seq_len: int,
             batch_size: int, num_batches: int | None = None) -> EvalResult:
    if seq_len < 1 or batch_size < 1 or (num_batches is not None and num_batches < 1):
        raise ValueError(f"seq_len, batch_size and num_batches must be >= 1, got {seq_len}, {batch_size}, {num_batches}")
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {model.cfg.vocab_size}")
    stream = PackedStream(open_documents(data, streaming=False, seq_len=seq_len), tokenizer, name="eval", index=0,
                          seed=0, shuffle=False, vocab_size=model.cfg.vocab_size, seq_len=seq_len, rank=0,
                          world_size=1).first_epoch()
    available = len(stream) - 1
    if available < 1:
        raise ValueError(f"{data.path} holds no tokens to evaluate")
    full_rows = available // seq_len
    if num_batches is not None and num_batches * batch_size > full_rows:
        raise ValueError(f"--batches {num_batches} x --batch-size {batch_size} rows of --seq-len {seq_len} ask for "
                         f"{num_batches * batch_size * seq_len:,} tokens, but {data.path} holds {available:,}; lower "
                         "--batches, or leave it out to evaluate every token once")
    rows = full_rows if num_batches is None else num_batches * batch_size
    rows_RT1 = torch.from_numpy(np.lib.stride_tricks.sliding_window_view(stream[:rows * seq_len + 1],
                                                                         seq_len + 1)[::seq_len].copy())
    pieces = list(rows_RT1.split(batch_size))
    tail = available - full_rows * seq_len if num_batches is None else 0
    if tail:  # the remainder: one shorter row
        pieces.append(torch.from_numpy(stream[full_rows * seq_len:]).view(1, tail + 1))
    device = model.embed.weight.device
    ce_sum, tokens = 0.0, 0
    with model.not_counting():  # evaluation leaves the expert-bias statistics alone
        for rows_BT1 in pieces:
            rows_BT1 = rows_BT1.to(device)
            _, ce = model(rows_BT1[:, :-1], rows_BT1[:, 1:])
            n = rows_BT1[:, 1:].numel()
            ce_sum += ce.double().item() * n
            tokens += n
    loss = ce_sum / tokens
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=tokens, available=available)
