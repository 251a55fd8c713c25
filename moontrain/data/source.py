"""The token-source protocol and the factory that picks one from data.source (the trainer's batches: loader.py)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from moontrain.data.config import DataConfig
from moontrain.data.tokenizer import ByteTokenizer, HFTokenizer


class TokenSource(Protocol):
    world: int  # the world size it shards over
    eos_id: int | None  # the end-of-document id packed rows carry (None: rows are not packed documents)
    tokenizer: ByteTokenizer | HFTokenizer | None  # what made the ids (None: synthetic ids, no tokenizer)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_bT, targets_bT) of this rank for optimizer step `step`, on the CPU."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's position (JSON-serialisable), saved in checkpoints."""
        ...

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        """Restore from the saved positions of every rank of the saving job (its world size may differ)."""
        ...


def build_token_source(cfg: DataConfig, *, vocab_size: int, seq_len: int, global_batch: int, rank: int,
                       world_size: int) -> TokenSource:
    kwargs = dict(vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch, rank=rank,
                  world_size=world_size)
    if cfg.source == "markov":
        from moontrain.data.markov import MarkovTokens

        return MarkovTokens(cfg, **kwargs)
    from moontrain.data.mixture import FileTokens

    return FileTokens(cfg, **kwargs)

