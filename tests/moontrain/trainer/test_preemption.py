"""Preemption and quiet-resume rules, in process:

- SIGTERM during fit: the step finishes, a checkpoint of that step is saved, fit returns; the handler
  leaves SIGTERM at its default action, so a second one aborts;
- a stop request on one rank of two: both ranks stop after the same step (the verdict is reduced), and
  so does a time-based save (checkpoint.every_minutes) due on one rank's clock only;
- resume: changed optim.* settings apply and are named; a changed train.steps names the LR schedule's new
  span and the lr it moves, and optim.schedule_steps keeps the old schedule bit for bit (then its final
  lr); train.steps below the checkpoint's step is an error; `resume: auto` names the incomplete checkpoint
  it passes over;
- one-line errors: an empty corpus and a null text value (from the real data path), malformed YAML.

References: the uninterrupted run's state at the same step (the preempted checkpoint must equal it bit
for bit); LambdaLR's formula with the new base lr for the resumed learning rate.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from moontrain.checkpoint.store import list_checkpoints
from moontrain.config.loader import load_recipe
from moontrain.data.config import DataConfig
from moontrain.data.loader import build_loader
from moontrain.optim.schedule import lr_multiplier
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.supervisor import Supervisor
from moontrain.trainer.errors import one_line
from moontrain.trainer.preempt import PreemptionHandler
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.worker import resolve_resume, resume_notes
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")


def _single(run_dir: Path, **kw) -> Trainer:
    torch.set_num_threads(1)
    return Trainer(small_config("local", 1, run_dir=str(run_dir), **kw), single_process_layout(CPU))


def _signal_at(trainer: Trainer, step: int, action) -> None:
    """Run `action` when the data of optimizer step `step` (0-based) is drawn, i.e. inside that step."""
    batch = trainer.data.batch

    def hooked(s: int):
        if s == step:
            action()
        return batch(s)

    trainer.data.batch = hooked


def test_sigterm_finishes_the_step_saves_and_returns(tmp_path: Path) -> None:
    reference = _single(tmp_path / "ref")
    train(reference, 3)
    trainer = _single(tmp_path / "run", checkpoint={"every": 0, "save_final": True})
    handler = PreemptionHandler(rank=0)
    try:
        trainer.preemption = handler
        _signal_at(trainer, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
        trainer.fit()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second SIGTERM aborts
    finally:
        handler.uninstall()
    assert trainer.stop_requested and trainer.step == 3 and handler.signal_name == "SIGTERM"
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000003"]
    fresh = _single(tmp_path / "run")
    fresh.load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert_bitwise(full_state(fresh), full_state(reference), "preempted checkpoint vs uninterrupted")


def test_a_second_signal_aborts(tmp_path: Path) -> None:
    """A process with the handler: the first SIGTERM sets the flag, SIGUSR1 (the launcher's) never aborts,
    the second SIGTERM kills it with the default action even while it sleeps in C."""
    script = (
        "import os, signal, time\n"
        "from moontrain.trainer.preempt import PreemptionHandler\n"
        "h = PreemptionHandler(rank=0)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.1)\n"
        "print('requested', h.requested, h.signal_name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
        "print('survived', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "requested True SIGTERM\n", proc.stdout
    assert proc.stderr.count("SIGTERM received: a stop request") == 1, proc.stderr


def test_the_launchers_stop_file_stops_without_a_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's request reaches the rank through MOONTRAIN_STOP_FILE even when no signal is handled
    (seen on an H200: SIGUSR1 sent to the rank's pid, its handler never ran, the run went on)."""
    stop_file = tmp_path / "stop"
    monkeypatch.setenv("MOONTRAIN_STOP_FILE", str(stop_file))
    reference = _single(tmp_path / "ref")
    train(reference, 3)
    trainer = _single(tmp_path / "run")
    handler = PreemptionHandler(rank=0)
    try:
        trainer.preemption = handler
        assert not handler.requested
        _signal_at(trainer, 2, lambda: stop_file.write_text("SIGTERM"))
        trainer.fit()
    finally:
        handler.uninstall()
    assert trainer.stop_requested and trainer.step == 3 and handler.signal_name == "SIGTERM to the launcher"
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000003"]
    assert_bitwise(full_state(trainer), full_state(reference), "stopped by the file vs uninterrupted")


def test_foreign_stop_file_does_not_stop_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture) -> None:
    """A stop file another user created (or a link) is ignored and named once: before, anyone who could create
    the file (it sat in /tmp) stopped the job."""
    if os.getuid() != 0:
        pytest.skip("making a file of another uid needs root")
    stop_file = tmp_path / "stop"
    monkeypatch.setenv("MOONTRAIN_STOP_FILE", str(stop_file))
    handler = PreemptionHandler(rank=0)
    try:
        stop_file.write_text("SIGTERM")
        os.chown(stop_file, 4321, 4321)
        assert not handler.requested and not handler.requested
        assert capfd.readouterr().err.count(f"ignoring the stop file {stop_file}: not a regular file of uid 0 "
                                            "(uid 4321") == 1
    finally:
        handler.uninstall()
    own = PreemptionHandler(rank=0)
    try:
        stop_file.unlink()
        stop_file.symlink_to(tmp_path / "elsewhere")
        (tmp_path / "elsewhere").write_text("SIGTERM")
        assert not own.requested
        stop_file.unlink()
        stop_file.write_text("SIGTERM")  # a stop file of this uid: the launcher's request
        assert own.requested and own.signal_name == "SIGTERM to the launcher"
    finally:
        own.uninstall()


def test_stop_file_is_private_to_the_launcher(tmp_path: Path) -> None:
    """The launcher's stop file is in a directory only its user can enter, under a name no one else sees; it is
    gone after the run. Before, it was /tmp/moontrain_stop_<random>, announced to every inotify watcher of /tmp."""
    probe = tmp_path / "probe"
    script = (f"import os, pathlib; p = os.environ['MOONTRAIN_STOP_FILE']; st = os.stat(os.path.dirname(p)); "
              f"pathlib.Path({str(probe)!r}).write_text(f'{{p}} {{st.st_mode & 0o777:o}} {{st.st_uid}}')")
    supervisor = Supervisor([sys.executable, "-c", script])
    assert supervisor.run() == 0
    path, mode, uid = probe.read_text().split()
    assert (Path(path).parent != Path(tempfile.gettempdir()), mode, int(uid)) == (True, "700", os.getuid())
    assert not Path(path).parent.exists()


def test_stop_message_claims_no_checkpoint_before_saving(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The line printed when SIGTERM arrives says it arrived; "saving a checkpoint" comes when the step is done
    and the save starts. Before, the signal's line promised the save, also when torchrun's SIGTERM after
    another rank's death was followed by no save at all."""
    trainer = _single(tmp_path)
    handler = PreemptionHandler(rank=0)
    try:
        trainer.preemption = handler
        _signal_at(trainer, 1, lambda: os.kill(os.getpid(), signal.SIGTERM))
        trainer.fit()
    finally:
        handler.uninstall()
    out = capfd.readouterr()
    assert "moontrain: rank 0: SIGTERM received: a stop request (send it again to abort at once)" in out.err
    assert "checkpoint" not in out.err and "saving" not in out.err, out.err
    assert "moontrain: stopping after step 2 as asked: saving a checkpoint" in out.out
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]


def _one_rank_asks(rank: int, world: int, run_dir: str) -> int:
    trainer = Trainer(small_config("alltoall", 2, run_dir=run_dir, steps=8), build_layout(2, CPU))

    class Flag:
        requested = False

    trainer.preemption = Flag()  # only the attribute is read; no signal handlers in the spawned ranks
    if rank == 1:
        _signal_at(trainer, 3, lambda: setattr(trainer.preemption, "requested", True))
    trainer.fit()
    return trainer.step


def test_a_stop_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    assert run_ranks(_one_rank_asks, 2, str(tmp_path)) == [4, 4]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004"]


def _one_rank_due(rank: int, world: int, run_dir: str) -> int:
    trainer = Trainer(small_config("alltoall", 2, run_dir=run_dir, steps=6, checkpoint={"every_minutes": 1.0}),
                      build_layout(2, CPU))
    if rank == 1:  # only rank 1's clock says a minute has passed, inside step 3
        _signal_at(trainer, 2, lambda: setattr(trainer, "last_save_time", trainer.last_save_time - 61))
    trainer.fit()
    return trainer.step


def test_a_time_based_save_on_one_rank_saves_on_every_rank_after_the_same_step(tmp_path: Path) -> None:
    assert run_ranks(_one_rank_due, 2, str(tmp_path)) == [6, 6]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000003", "step_00000006"]


def test_resume_applies_and_names_changed_optim_settings(tmp_path: Path) -> None:
    trainer = _single(tmp_path)
    train(trainer, 3)
    ckpt = trainer.save_checkpoint()
    cfg = small_config("local", 1, run_dir=str(tmp_path), checkpoint={"resume": "auto"})
    cfg.optim.lr, cfg.optim.weight_decay = 1e-3, 0.05
    resumed = Trainer(cfg, single_process_layout(CPU))
    state = resumed.load_checkpoint(resolve_resume(cfg, resumed.checkpoint_dir)[0])
    notes = resume_notes(cfg, resumed.checkpoint_dir, ckpt, state)
    assert notes == ["optim settings differ from the checkpoint's; the recipe's apply from here: optim.lr 0.003 -> "
                     "0.001, optim.weight_decay 0.1 -> 0.05"]
    want_lr = 1e-3 * lr_multiplier(3, cfg.optim, cfg.train.steps)
    for group in resumed.optimizer.param_groups:
        assert group["lr"] == want_lr and group["initial_lr"] == 1e-3
        assert group["weight_decay"] == (0.0 if group["name"] == "no_decay" else 0.05)
    assert resumed.scheduler.get_last_lr() == [want_lr] * len(resumed.optimizer.param_groups)

    same = small_config("local", 1, run_dir=str(tmp_path), steps=3, checkpoint={"resume": "auto"})
    assert resume_notes(same, resumed.checkpoint_dir, ckpt, state) == [
        "checkpoint is at train.steps=3 already: nothing to train"]
    below = small_config("local", 1, run_dir=str(tmp_path), steps=2, checkpoint={"resume": "auto"})
    with pytest.raises(ValueError, match=r"is at step 3, past train.steps=2: raise train.steps above 3"):
        resume_notes(below, resumed.checkpoint_dir, ckpt, state)


def test_longer_train_steps_names_the_schedule_change_and_can_keep_the_old_decay(tmp_path: Path) -> None:
    trainer = _single(tmp_path, steps=6)
    train(trainer, 3)
    ckpt = trainer.save_checkpoint()
    lr_at_3 = trainer.scheduler.get_last_lr()[0]
    for span in (None, 6):  # optim.schedule_steps: unset (the span follows train.steps 6 -> 8) or the old 6
        cfg = small_config("local", 1, run_dir=str(tmp_path), steps=8, checkpoint={"resume": "auto"})
        cfg.optim.schedule_steps = span
        resumed = Trainer(cfg, single_process_layout(CPU))
        notes = resume_notes(cfg, resumed.checkpoint_dir, ckpt, resumed.load_checkpoint(ckpt))
        lrs = []
        for _ in range(5):
            lrs.append(resumed.scheduler.get_last_lr()[0])
            resumed.train_step()
        want = [3e-3 * lr_multiplier(s, cfg.optim, span or 8) for s in range(3, 8)]
        assert lrs == want
        if span is None:
            assert lrs[0] != lr_at_3
            assert notes == [f"the LR schedule spanned 6 steps and now spans 8; it continues as configured: lr at "
                             f"step 3 {lr_at_3:.3e} -> {lrs[0]:.3e} (it follows train.steps=8); to keep the old decay and "
                             "run the steps past 6 at its final lr, set optim.schedule_steps=6"]
        else:  # the old schedule bit for bit, then its final lr past step 6
            assert notes == [] and lrs[0] == lr_at_3
            assert lrs[3:] == [3e-3 * cfg.optim.min_lr_ratio] * 2


def test_resume_auto_names_the_incomplete_checkpoint_it_skips(tmp_path: Path) -> None:
    trainer = _single(tmp_path)
    train(trainer, 1)
    good = trainer.save_checkpoint()
    train(trainer, 1)
    bad = trainer.save_checkpoint()
    (bad / "rank_00000.safetensors").unlink()
    cfg = small_config("local", 1, run_dir=str(tmp_path), checkpoint={"resume": "auto"})
    assert resolve_resume(cfg, trainer.checkpoint_dir) == (good, [])
    notes = resume_notes(cfg, trainer.checkpoint_dir, good, {"step": 1, "optim": {}})
    assert notes == [f"resume: auto passed over {bad} (incomplete: an interrupted save or missing files)"]


@pytest.mark.parametrize("content, match", [
    ("", r"StopIteration - no documents \(an empty corpus\?\)"),
    ('{"text": "hello"}\n{"text": null}\n', r"AttributeError: .* - a document without text \(a null value"),
])
def test_data_errors_are_one_line(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(content)
    cfg = DataConfig(source="dataset", path=str(path))
    with pytest.raises(Exception) as info:  # whatever the data libraries raise
        source = build_loader(cfg, vocab_size=257, seq_len=16, global_batch=2, rank=0, world_size=1, device=CPU)
        for step in range(4):
            source.batch(step)
    line = one_line(info.value, cfg)
    assert line is not None and "\n" not in line, line
    assert line.startswith("error: reading the training data failed: ") and f"data.path={str(path)!r}" in line
    assert re.search(match, line), line


def test_malformed_yaml_is_one_line(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  hidden_size: 64\n num_layers: 2\n")
    with pytest.raises(ValueError, match=rf"^recipe {recipe} is not valid YAML: line 3, column 2: ") as info:
        load_recipe(recipe)
    assert "\n" not in str(info.value)
    assert one_line(info.value, DataConfig()) == f"error: {info.value}"
