"""Held-out loss and perplexity, the same at every EP / DP layout.

Legend: G global batch (sequences), b = G / W rows per rank, T sequence length, n eval.steps.

The evaluation set is the first n G rows of the held-out data packed in file order as one stream (as a
single rank would pack it: documents back to back with EOS, rows of T + 1 tokens with stride T). Every
rank packs the same rows once, at start-up, and keeps its own b of each batch. The loss is the sum of the
per-token cross-entropies over all ranks divided by the n G T tokens (float64 sums, one all_reduce):
which rank computes which row changes only the fp32 summation order inside the model. So the number
compares across evaluations of one run and across layouts, and the same rows are used every time.

The forward runs without grad, with the routers' token counting off (the expert-bias update sees the
training tokens only), in micro-batches of the training micro-batch size; FSDP's gathered blocks are
released afterwards (a forward without backward would leave them gathered when
parallel.fsdp_reshard_after_forward=false).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moontrain.data.documents import open_documents
from moontrain.data.packed import PackedStream
from moontrain.data.tokenizer import check_vocab, load_tokenizer

if TYPE_CHECKING:
    from moontrain.config.eval_config import EvalConfig
    from moontrain.config.train_config import TrainConfig
    from moontrain.data.config import DataConfig
    from moontrain.model.transformer import K3Model
    from moontrain.parallel.layout import ParallelLayout


class Evaluator:
    """Reads eval (what to evaluate, how often), train (batch geometry, the last step) and data (the tokenizer).
    reshard_dense: drops FSDP's gathered blocks after the evaluation's forwards (Trainer.reshard_dense)."""

    def __init__(self, ev: EvalConfig, train: TrainConfig, data: DataConfig, model: K3Model, layout: ParallelLayout,
                 reshard_dense: Callable[[], None]) -> None:
        assert ev.data is not None
        self.model, self.layout, self.reshard_dense = model, layout, reshard_dense
        self.every, self.total_steps = ev.every, train.steps
        G, T, W = train.global_batch_size, train.seq_len, layout.world_size
        vocab_size = model.cfg.vocab_size
        tokenizer = load_tokenizer(data.tokenizer, eos_id=data.eos_id)
        check_vocab(data.tokenizer, tokenizer.vocab_size, vocab_size)
        stream = PackedStream(open_documents(ev.data, streaming=False, seq_len=T), tokenizer, name="eval", index=0,
                              seed=0, shuffle=False, vocab_size=vocab_size, seq_len=T, rank=0, world_size=1)
        rows_nGT1 = torch.from_numpy(stream.rows(ev.steps * G)).view(ev.steps, G, T + 1)
        b = G // W
        mine = rows_nGT1[:, layout.rank * b:(layout.rank + 1) * b].to(layout.device)
        self.tokens_nbT, self.targets_nbT = mine[..., :-1].contiguous(), mine[..., 1:].contiguous()
        self.num_tokens = ev.steps * G * T
        self.micro = train.micro_batch(W)

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.total_steps)

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """Collective: {'eval/loss', 'eval/ppl', 'eval/time_s'}."""
        t0 = time.perf_counter()
        model, layout = self.model, self.layout
        ce_sum = torch.zeros((), dtype=torch.float64, device=layout.device)
        try:
            with model.not_counting():
                for tokens_bT, targets_bT in zip(self.tokens_nbT, self.targets_nbT, strict=True):
                    for tok, tgt in zip(tokens_bT.split(self.micro), targets_bT.split(self.micro), strict=True):
                        _, ce = model(tok, tgt)
                        ce_sum += ce.double() * tgt.numel()
        finally:
            self.reshard_dense()
        if layout.distributed:
            dist.all_reduce(ce_sum, group=layout.world_group)
        loss = ce_sum.item() / self.num_tokens
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 700.0)), "eval/time_s": time.perf_counter() - t0}
