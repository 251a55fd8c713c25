"""ExpertWeights' storage: gate_up [epn, H, 2F] holds W_gate in its first F columns and W_up in the last F, and
init_master gives every matrix bitwise the values of a separate [epn, Hin, Hout] projection drawn in place
from the same per-expert generator (reference written here from the seed formula), at any EP rank and shard.
"""

from __future__ import annotations

import pytest
import torch

from moontrain.model.experts import ExpertWeights

E, H, FF = 8, 12, 20
STDS = {"gate": 0.02, "up": 0.03, "down": 0.005}
SEED, LAYER = 7, 3


def _separate_projections(ep_rank: int, ep: int) -> dict[str, torch.Tensor]:
    """gate, up [epn, H, F] and down [epn, F, H], each expert's matrix drawn in place from its own generator."""
    epn = E // ep
    out = {}
    for proj_idx, (name, shape) in enumerate((("gate", (H, FF)), ("up", (H, FF)), ("down", (FF, H)))):
        t = torch.empty(epn, *shape)
        for j in range(epn):
            gen = torch.Generator()
            gen.manual_seed(((SEED * 1009 + LAYER) * 3 + proj_idx) * 1_000_003 + ep_rank * epn + j)
            t[j].normal_(0.0, STDS[name], generator=gen)
        out[name] = t
    return out


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = (got != want).nonzero()
    assert not len(bad), f"{what}: first mismatch at {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


@pytest.mark.parametrize(("ep_rank", "ep", "shard"), [(0, 1, None), (1, 2, None), (1, 2, (1, 2))],
                         ids=["ep1", "ep2-rank1", "ep2-rank1-shard1of2"])
def test_init_master_equals_separate_projections(ep_rank: int, ep: int, shard: tuple[int, int] | None) -> None:
    w = ExpertWeights(num_experts=E, ep_rank=ep_rank, ep=ep, hidden=H, intermediate=FF)
    assert w.shapes == {"gate_up": (H, 2 * FF), "down": (FF, H)} and w.intermediate == FF
    rows = slice(None)
    if shard is not None:
        w.shard_state(*shard, None)
        per = w.num_local // shard[1]
        rows = slice(shard[0] * per, (shard[0] + 1) * per)
    w.init_master(seed=SEED, layer_idx=LAYER, stds=STDS)
    want = {name: t[rows] for name, t in _separate_projections(ep_rank, ep).items()}
    gate_up = w.master["gate_up"].detach()
    _assert_equal(gate_up[..., :FF], want["gate"], "gate_up[..., :F] vs gate")
    _assert_equal(gate_up[..., FF:], want["up"], "gate_up[..., F:] vs up")
    _assert_equal(w.master["down"].detach(), want["down"], "down")
