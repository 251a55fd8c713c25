"""Logged MoE statistics against independent references, at EP=2 with both backends.

References: the world-reduced router counts handed to each bias update (expert maxvio, and for alltoall
the rank maxvio from each rank's home experts), moonep's plans as prefetched (redundant experts, the
bytes each rank pulls = filled slots x one expert's fp32 weights), and a log_every=1 run of the same
training (a window's loss / grad norm / maxvio is the mean of its steps)."""

from __future__ import annotations

import pytest
import torch

from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import small_config

STEPS, WINDOW = 4, 2
EXPERT_BYTES = 3 * 32 * 64 * 4  # gate_up [32, 128] and down [64, 32] in fp32 (CPU compute dtype)


def _train(rank: int, world: int, backend: str) -> dict:
    per_step = Trainer(small_config(backend, 2), build_layout(2, torch.device("cpu")))
    reference = [per_step.train_step() for _ in range(STEPS)]
    per_step.close()

    cfg = small_config(backend, 2)
    cfg.train.log_every = WINDOW
    trainer = Trainer(cfg, build_layout(2, torch.device("cpu")))
    counts: list[list[torch.Tensor]] = [[] for _ in trainer.model.moe_layers()]
    for i, moe in enumerate(trainer.model.moe_layers()):
        update = moe.router.update_bias

        def recording_update(counts_E, i=i, update=update):
            counts[i].append(counts_E.clone())
            update(counts_E)

        moe.router.update_bias = recording_update
    plans: list[dict[int, object]] = []
    if backend == "moonep":
        pools = trainer.model.moe_layers()[0].backend.pools
        prefetch = pools.prefetch

        def recording_prefetch(plan, layer) -> None:
            plans[-1][layer.index] = plan
            prefetch(plan, layer)

        pools.prefetch = recording_prefetch
    logged = []
    for _ in range(STEPS):
        plans.append({})
        stats = trainer.train_step()
        if stats is not None:
            logged.append(stats)
    trainer.close()
    slots = [[(p.slot_expert_RB >= 0).sum().item() for _, p in sorted(step.items())] for step in plans]
    own_slots = [[(p.slot_expert_RB[rank] >= 0).sum().item() for _, p in sorted(step.items())] for step in plans]
    return {"reference": [(s.loss, s.grad_norm, s.max_maxvio) for s in reference],
            "logged": [(s.step, s.loss, s.grad_norm, s.scalars) for s in logged],
            "counts": [torch.stack(c) for c in counts], "slots": slots, "own_slots": own_slots}


def _maxvio(counts: torch.Tensor) -> float:
    c = counts.double()
    return (c.max() / c.mean() - 1).item()


@pytest.mark.parametrize("backend", ["moonep", "alltoall"])
def test_logged_moe_stats_match_references(backend: str) -> None:
    results = run_ranks(_train, 2, backend)
    r0 = results[0]
    assert [s[0] for s in r0["logged"]] == [2, 4]
    layer_ids = (1, 2)
    for w, (_step, loss, grad_norm, scalars) in enumerate(r0["logged"]):
        steps = range(w * WINDOW, (w + 1) * WINDOW)
        ref = r0["reference"]
        assert loss == pytest.approx(sum(ref[s][0] for s in steps) / WINDOW, rel=1e-6)
        assert grad_norm == pytest.approx(sum(ref[s][1] for s in steps) / WINDOW, rel=1e-6)
        for layer, layer_id in enumerate(layer_ids):
            counts = r0["counts"][layer]
            expert = sum(_maxvio(counts[s]) for s in steps) / WINDOW
            assert scalars[f"moe/expert_maxvio/layer{layer_id}"] == pytest.approx(expert, rel=1e-6, abs=1e-6)
            if backend == "moonep":
                rank, redundant = 0.0, sum(r0["slots"][s][layer] for s in steps) / WINDOW
                prefetch = sum(r["own_slots"][s][layer] for r in results for s in steps) / WINDOW / 2 * EXPERT_BYTES
            else:
                rank = sum(_maxvio(counts[s].view(2, -1).sum(-1)) for s in steps) / WINDOW
                redundant = prefetch = 0.0
            assert scalars[f"moe/rank_maxvio/layer{layer_id}"] == pytest.approx(rank, rel=1e-6, abs=1e-6)
            assert scalars[f"moe/redundant_experts/layer{layer_id}"] == redundant
            assert scalars[f"moe/prefetch_bytes/layer{layer_id}"] == pytest.approx(prefetch, rel=1e-12)
        per_layer = [scalars[f"moe/expert_maxvio/layer{i}"] for i in layer_ids]
        assert scalars["moe/expert_maxvio/max"] == max(per_layer)
    if backend == "moonep":
        assert sum(map(sum, r0["slots"])) > 0, "the test should exercise redundant experts"
    else:
        assert max(s[3]["moe/rank_maxvio/max"] for s in r0["logged"]) > 0
