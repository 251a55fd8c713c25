"""Packed rows of one file source on one rank, with an exactly resumable position.

Legend: W world size (every rank is a data-parallel consumer: EP ranks are borrowed from DP),
T sequence length.

Sharding: in epoch e the documents are taken in one global order (a permutation drawn from
(data.seed, source index, e), or the file order when streaming or data.shuffle=false); document number g
of that order belongs to rank g mod W. Two ranks never read the same document in an epoch, and together
they read each once. A rank moves to the next epoch when its share is exhausted.

Packing: a rank appends each of its documents' tokens (and an EOS, unless the documents carry their own)
to a running stream. Rows are windows of T + 1 tokens with stride T (row i = stream[iT, iT + T + 1)):
inputs are the first T, targets the last T, so no token is dropped and every document boundary is
visible through EOS. Flat token files are cut into blocks of T tokens (documents.py): at a block seam the
last target of a row is the first token of the rank's next block.

Position (state_dict): the epoch, the next global document index of this rank, the tokens carried
over (read but not yet trained on) and the documents they belong to. Restoring it at the same world
size continues with exactly the rows that would have come. At another world size the shares change:
every rank restarts at the round (W consecutive documents of the order) of the earliest document any
saved rank had not finished, so no document is skipped (a few are read again); carried tokens are
dropped. The epoch's order is the same at any world size (it depends on the seed, source and epoch only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from moontrain.data.documents import Document, Documents, StreamedFiles, TokenBlocks
from moontrain.data.tokenizer import ByteTokenizer, HFTokenizer


class PackedStream:
    def __init__(self, docs: Documents | TokenBlocks | StreamedFiles, tokenizer: ByteTokenizer | HFTokenizer, *,
                 name: str,
                 index: int, seed: int, shuffle: bool, vocab_size: int, seq_len: int, rank: int,
                 world_size: int) -> None:
        self.docs, self.tokenizer, self.name = docs, tokenizer, name
        self.seed, self.index, self.shuffle, self.vocab = seed, index, shuffle, vocab_size
        self.seq_len, self.rank, self.world = seq_len, rank, world_size
        self.eos = None if docs.has_eos else tokenizer.eos_id
        self.epoch, self.next_doc, self.carry = 0, rank, []
        self.pending: list[list[int]] = []  # [epoch, global index, end in carry] of documents not yet done
        self._order: np.ndarray | None = None
        self._stream: Iterator[tuple[int, Document]] | None = None

    # ------------------------------------------------------------------ reading
    def rows(self, n: int) -> np.ndarray:
        """The next n packed rows [n, T + 1] (int64) of this rank."""
        T = self.seq_len
        need = n * T + 1
        while len(self.carry) < need:
            epoch, g, doc = self._next_document()
            self.carry.extend(self._ids(g, doc))
            if self.eos is not None:
                self.carry.append(self.eos)
            self.pending.append([epoch, g, len(self.carry)])
        stream = np.asarray(self.carry[:need], dtype=np.int64)
        cut = n * T
        self.carry = self.carry[cut:]  # the last target is the next row's first input
        # a document is done when its last token has been a target, i.e. it ends at or before cut + 1
        self.pending = [[e, g, end - cut] for e, g, end in self.pending if end - cut > 1]
        return np.lib.stride_tricks.sliding_window_view(stream, T + 1)[::T].copy()

    def first_epoch(self) -> np.ndarray:
        """This rank's documents of the first epoch, each once and in its order, back to back with EOS (unless
        they carry their own), as one stream: a held-out set read exactly once (`moontrain eval`). Map-style
        sources only; the position is left alone."""
        assert not self.docs.streaming
        order = self._epoch_order(len(self.docs))
        tokens: list[int] = []
        for g in range(self.rank, len(self.docs), self.world):
            tokens += self._ids(g, self.docs.get(int(order[g])))
            if self.eos is not None:
                tokens.append(self.eos)
        return np.asarray(tokens, dtype=np.int64)

    def _ids(self, g: int, doc: Document) -> list[int]:
        if not self.docs.pretokenized:
            return self.tokenizer.encode_batch([doc])[0]
        ids = doc.tolist() if isinstance(doc, np.ndarray) else list(doc)
        if ids and (max(ids) >= self.vocab or min(ids) < 0):
            bad = max(ids) if max(ids) >= self.vocab else min(ids)
            raise ValueError(f"data source {self.name!r} ({self.docs.path}): document {g} holds token id {bad}, "
                             f"outside "
                             f"model.vocab_size={self.vocab}; set model.vocab_size above the tokenizer's largest id")
        return ids

    def _next_document(self) -> tuple[int, int, Document]:
        """(epoch, global index, document) of this rank's next document."""
        if self.docs.streaming:
            return self._next_streamed()
        n = len(self.docs)
        if self.next_doc >= n:
            self.epoch, self.next_doc, self._order = self.epoch + 1, self.rank, None
            if self.rank >= n:
                raise ValueError(f"data path {self.docs.path!r} has {n} documents, fewer than the {self.world} ranks")
        if self._order is None:
            self._order = self._epoch_order(n)
        g = self.next_doc
        self.next_doc += self.world
        return self.epoch, g, self.docs.get(int(self._order[g]))

    def _epoch_order(self, n: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.index, self.epoch]).permutation(n)

    def _next_streamed(self) -> tuple[int, int, Document]:
        for _ in range(2):
            if self._stream is None:
                self._stream = self.docs.iter_from(self.next_doc, self.world)
            for g, doc in self._stream:  # only this rank's documents are decoded
                assert g == self.next_doc, (g, self.next_doc)
                self.next_doc += self.world
                return self.epoch, g, doc
            self._stream = None  # the epoch's end
            if self.next_doc == self.rank:
                break
            self.epoch, self.next_doc = self.epoch + 1, self.rank
        raise ValueError(f"data path {self.docs.path!r} has fewer documents than the {self.world} ranks")

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next_doc": self.next_doc, "carry": list(self.carry),
                "pending": [list(p) for p in self.pending], "rank": self.rank, "world_size": self.world}

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        """rank_states: this source's saved state of every rank of the saving job, in rank order."""
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
