"""Expert optimizer state sharded over the dp_replicate replicas (parallel.shard_expert_state) == unsharded,
bitwise: losses, parameters, router biases and Adam state after a few steps, at world 4 = dp_replicate 2 x
EP 2 (alltoall and moonep) and world 2 = dp_replicate 2 x EP 1 (local); checkpoints saved sharded resume unsharded and
the reverse, bitwise against a run without interruption (the sharded Adam moments are saved as canonical rows
under their master's name). A layout whose local experts the replicas cannot split is rejected.

Reference: the same run unsharded (each element's AdamW update is elementwise, so the shard's step must equal
the whole tensor's rows bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moontrain.model.experts.weights import ExpertWeights
from moontrain.optim.adamw import build_optimizer
from moontrain.optim.config import OptimConfig
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import _full, assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")


def _trainer(backend: str, ep: int, shard: bool, run_dir: str) -> Trainer:
    cfg = small_config(backend, ep, steps=4, run_dir=run_dir)
    cfg.parallel.shard_expert_state = shard
    return Trainer(cfg, build_layout(ep, CPU))


def _canonical(trainer: Trainer) -> dict[str, torch.Tensor]:
    """full_state plus the sharded experts' Adam state, gathered over the replicas, under the master's name."""
    out = full_state(trainer)
    layout = trainer.layout
    masters = {id(p): n for n, p in trainer.model.named_parameters()}
    for w in trainer.experts:
        for proj, shard in w.shards.items():
            name = masters[id(w.master[proj])]
            for key, value in trainer.optimizer.state.get(shard, {}).items():
                if value.ndim == 0:
                    out[f"{name}.{key}"] = value.clone()
                    continue
                assert value.shape[0] == w.num_local // layout.dp_replicate == shard.shape[0], (key, value.shape)
                parts = [torch.empty_like(value) for _ in range(layout.dp_replicate)]
                dist.all_gather(parts, value.contiguous(), group=layout.edp_group)
                out[f"{name}.{key}"] = _full(trainer, name, torch.cat(parts))
    return out


def _sharded_vs_unsharded(rank: int, world: int, backend: str, ep: int, run_dir: str) -> None:
    torch.set_num_threads(1)
    states, losses = {}, {}
    for shard in (False, True):
        trainer = _trainer(backend, ep, shard, f"{run_dir}/{shard}")
        assert bool(trainer.experts[0].shards) == shard
        losses[shard] = train(trainer, 2)
        trainer.save_checkpoint()
        losses[shard] += train(trainer, 1)
        states[shard] = _canonical(trainer)
        trainer.close()
    assert losses[True] == losses[False], losses
    assert any(k.endswith("experts.master.up.exp_avg_sq") for k in states[False])
    assert_bitwise(states[True], states[False], "sharded expert state vs unsharded")
    for shard in (False, True):  # resume the other setting's checkpoint
        trainer = _trainer(backend, ep, shard, f"{run_dir}/resume{shard}")
        trainer.load_checkpoint(sorted(Path(f"{run_dir}/{not shard}/checkpoints").iterdir())[-1])
        resumed = train(trainer, 1)
        assert resumed == losses[False][2:], (shard, resumed, losses[False])
        assert_bitwise(_canonical(trainer), states[False], f"resumed shard_expert_state={shard}")
        trainer.close()


@pytest.mark.parametrize(("world", "backend", "ep"), [(4, "alltoall", 2), (4, "moonep", 2), (2, "local", 1)])
def test_sharded_equals_unsharded_and_resumes(tmp_path: Path, world: int, backend: str, ep: int) -> None:
    run_ranks(_sharded_vs_unsharded, world, backend, ep, str(tmp_path), timeout_s=600.0)


def test_rejects_indivisible_local_experts() -> None:
    w = ExpertWeights(num_experts=6, ep_rank=0, ep_size=2, hidden=4, intermediate=8)
    with pytest.raises(ValueError, match=r"3 local experts per EP rank over dp_replicate=2"):
        w.shard_state(0, 2, None)


@pytest.mark.parametrize(("optim", "match"), [({"name": "muon"}, "built for AdamW only"),
                                               ({"write_back": True}, "not built for the fused write-back AdamW")])
def test_refuses_unbuilt_optimizers(optim: dict, match: str) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=match):
        build_optimizer(model, OptimConfig(**optim), 4, expert_shards={id(model.weight): model.weight})
