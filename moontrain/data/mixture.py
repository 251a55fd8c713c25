"""Token batches from file sources: one source, or a weighted mixture; deterministic per seed, exactly resumable.

Legend: G global batch (rows), b = G / W rows per rank, S sources, T sequence length.

Each row of a global batch comes from one source: row i of step `step` draws source s with probability
weight_s / sum(weights), from a generator seeded by (data.seed, step). The draw depends on nothing else,
so it is the same at every world size and after any resume, and the expected token share of a source is
its weight (every row holds T tokens). Rank r takes rows [r b, (r + 1) b) and reads each source's rows
from its own packed stream of that source (packed.py). The position is the per-source stream positions
plus the tokens trained per source so far (the `data/tokens/<name>` metrics).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moontrain.data.config import DataConfig
from moontrain.data.documents import open_documents
from moontrain.data.packed import PackedStream
from moontrain.data.tokenizer import check_vocab, load_tokenizer


class FileTokens:
    def __init__(self, cfg: DataConfig, *, vocab_size: int, seq_len: int, global_batch: int, rank: int,
                 world_size: int) -> None:
        self.tokenizer = load_tokenizer(cfg.tokenizer, eos_id=cfg.eos_id)
        self.eos_id: int | None = self.tokenizer.eos_id  # ends every packed document
        check_vocab(cfg.tokenizer, self.tokenizer.vocab_size, vocab_size)
        sources = cfg.file_sources()
        self.names = list(sources)
        weights = np.array([s.weight for s in sources.values()], dtype=np.float64)
        self.p_S = weights / weights.sum()
        self.seed, self.seq_len, self.global_batch = cfg.seed, seq_len, global_batch
        self.rows, self.rank, self.world = global_batch // world_size, rank, world_size
        self.streams = [
            PackedStream(open_documents(src, streaming=cfg.streaming, seq_len=seq_len), self.tokenizer, name=name,
                         index=i, seed=cfg.seed, shuffle=cfg.shuffle, vocab_size=vocab_size, seq_len=seq_len,
                         rank=rank, world_size=world_size)
            for i, (name, src) in enumerate(sources.items())]
        self.tokens_by_source = [0] * len(self.streams)

    def choice(self, step: int) -> np.ndarray:
        """[G] source index of every row of the global batch of `step`."""
        if len(self.streams) == 1:
            return np.zeros(self.global_batch, dtype=np.int64)
        return np.random.default_rng([self.seed, step]).choice(len(self.streams), size=self.global_batch, p=self.p_S)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_bT, targets_bT) of this rank for optimizer step `step`, on the CPU."""
        choice_G = self.choice(step)
        mine_b = choice_G[self.rank * self.rows:(self.rank + 1) * self.rows]
        rows_bT1 = np.empty((self.rows, self.seq_len + 1), dtype=np.int64)
        for s, stream in enumerate(self.streams):
            at = np.flatnonzero(mine_b == s)
            if len(at):
                rows_bT1[at] = stream.rows(len(at))
        for s, n in enumerate(np.bincount(choice_G, minlength=len(self.streams)).tolist()):
            self.tokens_by_source[s] += n * self.seq_len
        local = torch.from_numpy(rows_bT1)
        return local[:, :-1].contiguous(), local[:, 1:].contiguous()

    def metrics(self) -> dict[str, float]:
        return {f"data/tokens/{name}": float(n) for name, n in zip(self.names, self.tokens_by_source, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return {"sources": {name: s.state_dict() for name, s in zip(self.names, self.streams, strict=True)},
                "tokens_by_source": dict(zip(self.names, self.tokens_by_source, strict=True))}

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        saved = set(rank_states[0]["sources"])
        if saved != set(self.names):
            raise ValueError(f"the checkpoint's data sources are {sorted(saved)}, the run's are {sorted(self.names)}; "
                             "resume with the same data.sources names")
        for name, stream in zip(self.names, self.streams, strict=True):
            stream.load_state_dict([r["sources"][name] for r in rank_states])
        self.tokens_by_source = [int(rank_states[0]["tokens_by_source"][name]) for name in self.names]
