"""The launcher's look at the run directory before any worker starts (planning.resume_check): a checkpoint
the new settings cannot continue is refused in one line naming every difference and the two ways out;
a run at train.steps is reported finished and nothing starts.

Reference: the settings the checkpoint was saved with (a k3_tiny trainer on one process) against the
overrides each case applies; the launch must return before the Supervisor would start torchrun.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain import cli
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import single_process_layout
from moontrain.planning.resume_check import check_resume
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import train

REPO = Path(__file__).resolve().parents[3]
ONE_RANK = ["parallel.ep=1", "experts.backend=local", "metrics.wandb=false", "train.log_every=1"]


def _cfg(run_dir: Path, *overrides: str) -> RunConfig:
    return from_dict(RunConfig, load_recipe(REPO / "recipes/k3_tiny.yaml",
                                            [*ONE_RANK, f"train.run_dir={run_dir}", *overrides]))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A k3_tiny run trained 2 of train.steps=2 steps (its final checkpoint at step 2)."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("run")
    trainer = Trainer(_cfg(path, "train.steps=2"), single_process_layout(torch.device("cpu")))
    train(trainer, 2)
    trainer.save_checkpoint()
    return path


@pytest.mark.parametrize(("overrides", "differs"), [
    (["optim.name=muon"], "optim.name adamw -> muon"),
    (["model.hidden_size=128", "model.num_layers=4"], "model.hidden_size 64 -> 128, model.num_layers 3 -> 4"),
    (["data.source=markov"], "data.source dataset -> markov"),
    ([f"data.tokenizer={REPO}/recipes/data/tiny_tokenizer.json"],  # the same model: only the ids' meaning differs
     f"data.tokenizer bytes -> {REPO}/recipes/data/tiny_tokenizer.json"),
])
def test_a_checkpoint_the_settings_cannot_continue_is_refused_in_one_line(run_dir: Path, overrides: list[str],
                                                                         differs: str) -> None:
    with pytest.raises(ValueError) as err:
        check_resume(_cfg(run_dir, "train.steps=10", *overrides))
    assert str(err.value) == (f"{run_dir} holds a run at step 2 ({run_dir}/checkpoints/step_00000002) that these "
                              f"settings cannot continue: {differs}; start a new run with another "
                              "train.run_dir=..., or set checkpoint.resume=none to start over here (the earlier "
                              "checkpoints are moved aside)")
    assert check_resume(_cfg(run_dir, "train.steps=10", "checkpoint.resume=none", *overrides)) is None


def test_what_a_checkpoint_can_continue_passes(run_dir: Path) -> None:
    resume = check_resume(_cfg(run_dir, "train.steps=10", "optim.lr=1e-3", "train.global_batch_size=4"))
    assert resume is not None and resume.step == 2 and resume.checkpoint == run_dir / "checkpoints/step_00000002"
    with pytest.raises(ValueError, match=r"is at step 2, past train.steps=1: raise train.steps above 2"):
        check_resume(_cfg(run_dir, "train.steps=1"))


def test_the_launcher_refuses_or_reports_finished_before_any_worker(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def no_workers(*args, **kwargs):
        raise AssertionError("the launch started torchrun")

    monkeypatch.setattr(cli, "run_workers", no_workers)
    launch = ["launch", str(REPO / "recipes/k3_tiny.yaml"), *ONE_RANK, f"train.run_dir={run_dir}", "--nproc", "1"]
    assert cli.main([*launch, "train.steps=10", "optim.name=muon"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moontrain: error: ") and "optim.name adamw -> muon" in err, err
    assert cli.main([*launch, "train.steps=2"]) == 0
    assert capsys.readouterr().out == (f"moontrain: {run_dir} is finished: {run_dir}/checkpoints/step_00000002 is at "
                                       "train.steps=2; raise train.steps to train on, or set checkpoint.resume=none "
                                       "to start over (the earlier checkpoints are moved aside)\n")
