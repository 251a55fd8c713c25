"""The layers a run recomputes, as the trainer chooses them at launch (moontrain.trainer.recompute), on the CPU:
"auto" recomputes nothing there (the launch checks the host's memory instead); the other settings name their
layers, and the model is built with exactly those blocks recomputed."""

from __future__ import annotations

import pytest
import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import ParallelLayout
from moontrain.planning.activations import recompute_order
from moontrain.trainer.recompute import recomputed_layers

CPU = ParallelLayout(world_size=1, rank=0, ep=1, device=torch.device("cpu"))


@pytest.mark.parametrize(("setting", "want"), [("auto", ()), ("false", ()), ("true", tuple(range(16))), ("3", None)])
def test_the_trainer_takes_the_named_layers(setting: str, want: tuple[int, ...] | None) -> None:
    cfg = from_dict(RunConfig, load_recipe("recipes/k3_small.yaml",
                                           ["parallel.ep=1", f"train.activation_checkpointing={setting}"]))
    if want is None:
        want = tuple(sorted(recompute_order(cfg, 4)[:3]))
        assert len(want) == 3
    assert recomputed_layers(cfg, CPU, 4) == want
