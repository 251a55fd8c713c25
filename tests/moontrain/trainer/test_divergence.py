"""Divergence: nonsense optimizer/model settings are refused; a non-finite step is skipped (weights and Adam
state bitwise untouched, the skip counted); consecutive skips stop the run and the newest finite
checkpoint survives keep_last; an interrupted prune leaves no debris that outlives the next save.

References: the state captured before the bad step (a skip must leave it bit for bit); the finiteness of
every tensor read back from the kept checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moontrain.checkpoint import store
from moontrain.checkpoint.store import list_checkpoints
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.guard import DivergenceError
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")
RECIPE = Path(__file__).resolve().parents[3] / "recipes/k3_tiny.yaml"


@pytest.mark.parametrize("override, match", [
    ("optim.eps=0", r"optim.eps must be a finite number > 0"),
    ("optim.lr=.inf", r"optim.lr: expected a finite float, got inf"),
    ("optim.lr=.nan", r"optim.lr: expected a finite float, got nan"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay must be a finite number >= 0"),
    ("optim.beta2=1", r"optim.beta2 must be in \[0, 1\)"),
    ("model.router_bias_update_rate=-0.001", r"model.router_bias_update_rate must be a finite number >= 0"),
    ("model.norm_eps=-1e-6", r"model.norm_eps must be a finite number > 0"),
    ("model.norm_eps=0", r"model.norm_eps must be a finite number > 0"),
    ("parallel.timeout_s=0", r"parallel.timeout_s must be a finite number of seconds > 0"),
    ("parallel.heartbeat_timeout_s=900", r"parallel.heartbeat_timeout_s=900.0 must be >= 0 \(0 disables\) and below "
                                         r"parallel.timeout_s=600.0"),
    ("train.max_skipped_steps=0", r"train.max_skipped_steps must be >= 1"),
])
def test_nonsense_settings_are_refused(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_dict(RunConfig, load_recipe(RECIPE, [override]))


def _single(run_dir: Path, **kw) -> Trainer:
    torch.set_num_threads(1)
    return Trainer(small_config("local", 1, run_dir=str(run_dir), **kw), single_process_layout(CPU))


def test_non_finite_step_is_skipped_and_counted(tmp_path: Path) -> None:
    trainer = _single(tmp_path)
    train(trainer, 2)
    before = full_state(trainer)
    embed = trainer.model.embed.weight
    handle = embed.register_hook(lambda g: g * float("nan"))
    train(trainer, 1)
    handle.remove()
    assert trainer.step == 3 and trainer.guard.total == 1 and trainer.guard.consecutive == 1
    assert_bitwise(full_state(trainer), before, "after a skipped step")
    for w in trainer.experts:  # the compute copies still equal the masters, the grads are dropped
        for name, master in w.master.items():
            assert torch.equal(w.compute[name].float(), master.detach()), name
            assert not w.grad[name].any() and master.grad is None, name
    assert all(p.grad is None for p in trainer.dense_params)
    logged = trainer.train_step()
    assert logged is not None and logged.scalars["skipped_steps"] == 1.0
    assert trainer.guard.consecutive == 0 and logged.loss == logged.loss  # finite again


def _poisoned_vs_forced_skip(rank: int, world: int, run_dir: str) -> None:
    """Step 3 skipped twice: once because its loss is NaN (so every gradient is, moonep's deferred-zero
    grads and slot grads included), once forced with finite grads. Nothing of the NaN step may leak into
    the later steps: the two runs end bitwise equal."""
    states = []
    for poison in (True, False):
        trainer = Trainer(small_config("moonep", 2, run_dir=run_dir, steps=5), build_layout(2, CPU))
        train(trainer, 2)
        if poison:
            handle = trainer.model.register_forward_hook(lambda m, args, out: (out[0] * float("nan"), out[1]))
        else:
            admit = trainer.guard.admit
            trainer.guard.admit = lambda finite, step, admit=admit: admit(False, step)
        train(trainer, 1)
        if poison:
            handle.remove()
        else:
            trainer.guard.admit = admit
        assert trainer.guard.total == 1
        train(trainer, 2)
        states.append(full_state(trainer))
        trainer.close()
    assert_bitwise(states[0], states[1], f"rank {rank}: NaN-skipped vs force-skipped step 3")


@pytest.mark.slow
def test_a_nan_step_leaves_nothing_behind_ep2_moonep(tmp_path: Path) -> None:
    run_ranks(_poisoned_vs_forced_skip, 2, str(tmp_path))


def test_divergence_stops_and_keeps_the_newest_finite_checkpoint(tmp_path: Path) -> None:
    trainer = _single(tmp_path, steps=12, checkpoint={"every": 1, "keep_last": 1})
    trainer.guard.max_skipped_steps = 3
    train(trainer, 1)
    trainer.save_checkpoint()
    with torch.no_grad():  # what an overflowing update leaves behind: every later step is non-finite
        trainer.model.embed.weight.fill_(float("inf"))
    with pytest.raises(DivergenceError, match=r"3 consecutive steps .* non-finite"):
        trainer.fit()
    root = tmp_path / "checkpoints"
    kept = list_checkpoints(root)
    assert [p.name for p in kept] == ["step_00000001", "step_00000003"]  # the finite one and keep_last's
    assert [json.loads((p / "manifest.json").read_text())["finite"] for p in kept] == [True, False]
    tensors = load_file(str(kept[0] / "rank_00000.safetensors"))
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, bad
    assert not torch.isfinite(load_file(str(kept[1] / "rank_00000.safetensors"))["model.embed.weight"]).any()


def test_interrupted_prune_leaves_no_debris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _single(tmp_path, checkpoint={"keep_last": 1})
    root = tmp_path / "checkpoints"
    train(trainer, 1)
    trainer.save_checkpoint()
    train(trainer, 1)
    real_rmtree = store.shutil.rmtree

    def killed_midway(path: Path) -> None:  # deletes the manifest and one rank file, then "dies"
        (Path(path) / "manifest.json").unlink()
        (Path(path) / "rank_00000.safetensors").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(store.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()
    monkeypatch.setattr(store.shutil, "rmtree", real_rmtree)
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002"]
    train(trainer, 1)
    trainer.save_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
