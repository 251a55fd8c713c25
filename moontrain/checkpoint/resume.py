"""Which checkpoint a job starts from: relaunching a run resumes it; starting over is an explicit choice.

checkpoint.resume:
  - `auto` (the default): the latest complete checkpoint of the checkpoint directory; a fresh start when
    there is none. Relaunching the same command after a crash or a kill continues the run.
  - `none`: start over. The earlier run's checkpoints are moved into `<checkpoint dir>/discarded-<time>/`
    and its metrics.jsonl to `metrics.discarded-<time>.jsonl` (nothing is deleted, and a later `auto`
    cannot pick up the old run's higher steps).
  - a checkpoint directory: that one (it must exist).
"""

from __future__ import annotations

import time
from pathlib import Path

from moontrain.checkpoint.config import CheckpointConfig
from moontrain.checkpoint.store import find_latest, list_checkpoints

START_OVER = "to start over in this run directory set checkpoint.resume=none (the earlier checkpoints and metrics "\
             "are moved aside), or use another train.run_dir"


def resolve_resume(cfg: CheckpointConfig, checkpoint_dir: Path) -> Path | None:
    """The checkpoint to load, or None for a fresh start."""
    resume = cfg.resume
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(checkpoint_dir)
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"checkpoint.resume={resume!r} is not a directory; use none, auto or a checkpoint path "
                         f"such as {checkpoint_dir}/step_00000100")
    return path


def set_aside_earlier_run(checkpoint_dir: Path, run_dir: Path) -> Path | None:
    """checkpoint.resume=none (rank 0, before training): move the earlier run's checkpoints and metrics.jsonl
    aside; returns the folder they went to (None when there was nothing)."""
    earlier = list_checkpoints(checkpoint_dir)
    metrics = run_dir / "metrics.jsonl"
    if not earlier and not (metrics.is_file() and metrics.stat().st_size):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = checkpoint_dir / f"discarded-{stamp}"
    if earlier:
        target.mkdir(parents=True, exist_ok=True)
        for path in earlier:
            path.rename(target / path.name)
    if metrics.is_file():
        metrics.rename(run_dir / f"metrics.discarded-{stamp}.jsonl")
    return target
