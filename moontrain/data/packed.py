"""Packed token batches from documents, sharded over ranks, with an exactly resumable position.

Legend: W world size (every rank is a data-parallel consumer: EP ranks are borrowed from DP),
b = G / W rows per rank, T sequence length.

Sharding: in epoch e the documents are taken in one global order (a permutation drawn from
(data.seed, e), or the file order when streaming); document number g of that order belongs to rank
g mod W. Two ranks never read the same document in an epoch, and together they read each once.
A rank moves to the next epoch when its share is exhausted.

Packing: a rank appends each of its documents' tokens and an EOS to a running stream. A batch is b
windows of T + 1 tokens with stride T (row i = stream[iT, iT + T + 1)): inputs are the first T, targets
the last T, so no token is dropped and every document boundary is visible through EOS.

Position (state_dict): the epoch, the next global document index of this rank, the tokens carried
over (read but not yet trained on) and the documents they belong to. Restoring it at the same world
size continues with exactly the batch that would have come. At another world size the shares change:
every rank restarts at the round (W consecutive documents of the order) of the earliest document any
saved rank had not finished, so no document is skipped (a few are read again); carried tokens are
dropped. The epoch's order is the same at any world size (it depends on the seed and epoch only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from moontrain.data.config import DataConfig
from moontrain.data.documents import Documents
from moontrain.data.tokenizer import ByteTokenizer


class PackedDocuments:
    def __init__(self, cfg: DataConfig, *, vocab_size: int, seq_len: int, global_batch: int, rank: int,
                 world_size: int, device: torch.device) -> None:
        self.tokenizer = ByteTokenizer()
        self.eos_id: int | None = self.tokenizer.eos_id
        if self.tokenizer.vocab_size > vocab_size:
            raise ValueError(f"data.tokenizer={cfg.tokenizer} has {self.tokenizer.vocab_size} ids but "
                             f"model.vocab_size={vocab_size}; set model.vocab_size >= {self.tokenizer.vocab_size}")
        self.cfg, self.seq_len, self.device = cfg, seq_len, device
        self.rows, self.rank, self.world = global_batch // world_size, rank, world_size
        self.docs = Documents(cfg)
        self.epoch, self.next_doc, self.carry = 0, rank, []
        self.pending: list[list[int]] = []  # [epoch, global index, end in carry] of documents not yet done
        self._order: np.ndarray | None = None
        self._stream: Iterator[tuple[int, str]] | None = None

    # ------------------------------------------------------------------ reading
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_bT, targets_bT) of this rank: the next b packed rows (the position is the state; `step`
        is the trainer's and not needed here)."""
        T, b = self.seq_len, self.rows
        need = b * T + 1
        while len(self.carry) < need:
            epoch, g, text = self._next_document()
            self.carry.extend(self.tokenizer.encode(text))
            self.carry.append(self.tokenizer.eos_id)
            self.pending.append([epoch, g, len(self.carry)])
        stream = torch.tensor(self.carry[:need], dtype=torch.long)
        cut = b * T
        self.carry = self.carry[cut:]  # the last target is the next batch's first input
        # a document is done when its last token (EOS) has been a target, i.e. it ends at or before cut + 1
        self.pending = [[e, g, end - cut] for e, g, end in self.pending if end - cut > 1]
        rows_bT1 = stream.unfold(0, T + 1, T)
        rows_bT1 = rows_bT1.to(self.device)
        return rows_bT1[:, :-1].contiguous(), rows_bT1[:, 1:].contiguous()

    def _next_document(self) -> tuple[int, int, str]:
        """(epoch, global index, text) of this rank's next document."""
        if self.docs.streaming:
            return self._next_streamed()
        n = len(self.docs)
        if self.next_doc >= n:
            self.epoch, self.next_doc, self._order = self.epoch + 1, self.rank, None
            if self.rank >= n:
                raise ValueError(f"data.path={self.cfg.path!r} has {n} documents, fewer than the {self.world} ranks")
        if self._order is None:
            self._order = self._epoch_order(n)
        g = self.next_doc
        self.next_doc += self.world
        return self.epoch, g, self.docs.get(int(self._order[g]))

    def _epoch_order(self, n: int) -> np.ndarray:
        if not self.cfg.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.cfg.seed, self.epoch]).permutation(n)

    def _next_streamed(self) -> tuple[int, int, str]:
        for _ in range(2):
            if self._stream is None:
                self._stream = self.docs.iter_from(self.next_doc)
            for g, text in self._stream:
                if g == self.next_doc:
                    self.next_doc += self.world
                    return self.epoch, g, text
            self._stream = None  # the epoch's end
            if self.next_doc == self.rank:
                break
            self.epoch, self.next_doc = self.epoch + 1, self.rank
        raise ValueError(f"data.path={self.cfg.path!r} has fewer documents than the {self.world} ranks")

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next_doc": self.next_doc, "carry": list(self.carry),
                "pending": [list(p) for p in self.pending], "rank": self.rank, "world_size": self.world}

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        """rank_states: the saved state of every rank of the saving job, in rank order."""
        self._order, self._stream = None, None
        if len(rank_states) == self.world:
            mine = rank_states[self.rank]
            assert mine["rank"] == self.rank and mine["world_size"] == self.world
            self.epoch, self.next_doc, self.carry = mine["epoch"], mine["next_doc"], list(mine["carry"])
            self.pending = [list(p) for p in mine["pending"]]
            return
        # another world size: every rank restarts at the round of the earliest unfinished document
        def first_unfinished(s: dict[str, Any]) -> tuple[int, int]:
            epoch, g = (s["pending"][0][0], s["pending"][0][1]) if s["pending"] else (s["epoch"], s["next_doc"])
            return epoch, g - s["rank"]  # g - rank: the start of that round of the saving job

        epoch, first = min(first_unfinished(s) for s in rank_states)
        self.epoch, self.next_doc, self.carry, self.pending = epoch, first + self.rank, [], []
