"""Careless relaunches, through the worker's own path (moontrain.trainer.worker._train on one spawned gloo rank):

- a relaunch into a run directory with another train.seed or data.seed stops with the key named, before it
  touches the directory (config.yaml keeps the run's seeds);
- a second job on a run directory whose lock is held stops naming the holder (host, pid) before it writes
  anything; once the holder has exited the directory is free again, with no stale lock.

Reference: the seeds the first launch wrote; the holder's pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moontrain.checkpoint.store import list_checkpoints, open_checkpoint
from moontrain.trainer import worker
from moontrain.trainer.run_lock import RunLock
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import small_config

REPO = Path(__file__).resolve().parents[3]


class _NoSignals:
    requested = False
    signal_name = None


def _launch(run_dir: str, steps: int, **seeds: int) -> str | None:
    """One launch's worker body; returns its ValueError's message, or None."""
    cfg = small_config("local", 1, run_dir=run_dir, steps=steps, checkpoint={"save_final": True})
    cfg.train.seed = seeds.get("train_seed", cfg.train.seed)
    cfg.data.seed = seeds.get("data_seed", cfg.data.seed)
    try:
        worker._train(cfg, worker.select_device()[0], _NoSignals())
    except ValueError as err:
        return str(err)
    return None


def _relaunches(run_dir: str) -> list[str | None]:
    return [_launch(run_dir, 1), _launch(run_dir, 2, train_seed=6), _launch(run_dir, 2, data_seed=99)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, Path, tuple]:
    """Both scenarios in one spawned rank (a process start and a model build cost seconds on the CI machine)."""
    seeds_dir, lock_dir = tmp_path_factory.mktemp("seeds"), tmp_path_factory.mktemp("lock")
    relaunches, second_job = run_ranks(_both, 1, str(seeds_dir), str(lock_dir))[0]
    return seeds_dir, relaunches, lock_dir, second_job


def _both(rank: int, world: int, seeds_dir: str, lock_dir: str) -> tuple[list, tuple]:
    return _relaunches(seeds_dir), _second_job(lock_dir)


def test_relaunch_with_another_seed_is_refused(launches: tuple) -> None:
    """Before, the relaunch continued the old run and rewrote config.yaml with the new seed."""
    tmp_path, (first, train_seed, data_seed), _, _ = launches
    assert first is None
    assert train_seed.startswith(f"train.seed=6 (the checkpoint's is 5): a relaunch continues the run in {tmp_path} "
                                 "with the seeds it started with; relaunch with the checkpoint's, or start over with "
                                 "checkpoint.resume=none"), train_seed
    assert data_seed.startswith("data.seed=99 (the checkpoint's is 1234)"), data_seed
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (written["train"]["seed"], written["data"]["seed"]) == (5, 1234)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000001"]
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    named = small_config("local", 1, run_dir=str(tmp_path), checkpoint={"resume": str(ckpt)})
    named.train.seed = 6  # resuming a named checkpoint is a deliberate choice: it goes on, and says what differs
    notes = worker.resume_notes(named, ckpt.parent, ckpt, open_checkpoint(ckpt)[0])
    assert [n for n in notes if n.startswith("seeds")] == [  # (another note names the LR schedule's new span)
        "seeds differ from the checkpoint's, which fixed the weights and data order so far: train.seed=6 (the "
        "checkpoint's is 5)"]


_HOLDER = """
import sys, time
from pathlib import Path
from moontrain.trainer.run_lock import RunLock
assert RunLock(Path(sys.argv[1])).acquire() is None
print("held", flush=True)
time.sleep(60)
"""


def _second_job(run_dir: str) -> tuple[str | None, str | None]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, run_dir], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        locked_out = _launch(run_dir, 1)
        assert locked_out is not None and f"pid {holder.pid}," in locked_out, locked_out
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(Path(run_dir))
    free = lock.acquire()  # the kernel dropped the killed holder's flock: no stale lock
    lock.release()
    return locked_out, free


def test_second_job_on_a_run_dir_is_locked_out(launches: tuple) -> None:
    """Before, two jobs trained into one run directory side by side."""
    _, _, tmp_path, (locked_out, after) = launches
    assert locked_out.startswith(f"run directory {tmp_path} is in use by another job (host "), locked_out
    assert locked_out.endswith(f"lock {tmp_path / '.lock'}): wait for it to finish or stop it, or set another "
                               "train.run_dir"), locked_out
    assert after is None and list_checkpoints(tmp_path / "checkpoints") == []
    assert not (tmp_path / "config.yaml").exists()  # the refused job wrote nothing
