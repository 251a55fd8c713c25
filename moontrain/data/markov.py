"""A synthetic token source with learnable structure: a fixed sparse Markov chain.

Legend: G global batch (sequences), T sequence length, V vocab, b branching.

Every token has `branching` successors drawn once from the data seed; each next token is one of them,
uniformly. A model that learns the table reaches a loss of log(branching), far below log(V), so
"the loss falls" is a meaningful check. Batch `step` is a pure function of (seed, step): the global
batch is generated identically on every rank and each rank takes its contiguous slice, so any
parallel layout trains on exactly the same tokens. Having no position of its own, it resumes exactly at
any layout (its state is empty).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moontrain.data.config import DataConfig


class MarkovTokens:
    def __init__(self, cfg: DataConfig, *, vocab_size: int, seq_len: int, global_batch: int, rank: int,
                 world_size: int) -> None:
        self.cfg, self.vocab, self.seq_len = cfg, vocab_size, seq_len
        self.global_batch, self.rank, self.world = global_batch, rank, world_size
        self.eos_id = None  # one endless walk per row, no documents
        self.tokenizer = None  # synthetic ids
        gen = torch.Generator().manual_seed(cfg.seed)
        self.successors_Vb = torch.randint(0, vocab_size, (vocab_size, cfg.branching), generator=gen)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_bT, targets_bT) of this rank for optimizer step `step`, on the CPU."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        G, T = self.global_batch, self.seq_len
        # draw the random numbers of the whole global batch (cheap), walk the chain for local rows only
        start_G = torch.randint(0, self.vocab, (G,), generator=gen)
        choice_GT = torch.randint(0, self.cfg.branching, (G, T), generator=gen)
        b = G // self.world
        rows = slice(self.rank * b, (self.rank + 1) * b)
        succ, choice = self.successors_Vb.numpy(), choice_GT[rows].numpy()
        seq_bT1 = np.empty((b, T + 1), dtype=np.int64)
        seq_bT1[:, 0] = start_G[rows].numpy()
        for t in range(T):  # numpy: ~3x faster than torch indexing for these tiny per-step gathers
            seq_bT1[:, t + 1] = succ[seq_bT1[:, t], choice[:, t]]
        local = torch.from_numpy(seq_bT1)
        return local[:, :-1].contiguous(), local[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        pass
