"""The synthetic Markov token source: rank slices tile the single-process global batch exactly, targets
are the next tokens, and every transition is one of the chain's successors."""

from __future__ import annotations

import torch

from moontrain.data.config import DataConfig
from moontrain.data.markov import MarkovTokens


def _source(rank: int, world: int) -> MarkovTokens:
    return MarkovTokens(DataConfig(seed=7, branching=3), vocab_size=50, seq_len=33, global_batch=8, rank=rank,
                        world_size=world)


def test_rank_slices_tile_the_global_batch() -> None:
    full_tokens, full_targets = _source(0, 1).batch(5)
    for world in (2, 4):
        parts = [_source(r, world).batch(5) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), full_tokens)
        assert torch.equal(torch.cat([p[1] for p in parts]), full_targets)
    assert not torch.equal(_source(0, 1).batch(6)[0], full_tokens)  # batches differ per step


def test_targets_follow_the_chain() -> None:
    src = _source(0, 1)
    tokens, targets = src.batch(0)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    allowed = src.successors_Vb[tokens]  # [G, T, branching]
    assert (allowed == targets.unsqueeze(-1)).any(-1).all()
