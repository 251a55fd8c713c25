"""Which checkpoint a job starts from: relaunching a run resumes it; starting over is an explicit choice.

checkpoint.resume:
  - `auto` (the default): the latest good checkpoint of the checkpoint directory; a fresh start when
    there is none. Relaunching the same command after a crash or a kill continues the run. A newer
    checkpoint that is incomplete (store.is_complete) or whose files fail their digests is passed over
    and named.
  - `none`: start over. The earlier run's checkpoints are moved into `<checkpoint dir>/discarded-<time>/`
    and its metrics.jsonl to `metrics.discarded-<time>.jsonl` (nothing is deleted, and a later `auto`
    cannot pick up the old run's higher steps).
  - a checkpoint directory: that one (it must exist and pass its digests).

The choice is made once for all ranks: every file of a candidate is verified against the manifest by one
rank (file i by rank i % world, hashing spread over the ranks), the verdicts are gathered, and every rank
gets the same answer before any of them loads (which then skips the digests: load_checkpoint(verified=True)).
A rank never reports a resume that another rank's file would then refuse.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from moontrain.checkpoint.config import CheckpointConfig
from moontrain.checkpoint.manifest import MANIFEST, read_manifest
from moontrain.checkpoint.store import list_checkpoints
from moontrain.checkpoint.tensors import CheckpointError, verify_file
from moontrain.parallel.layout import ParallelLayout

START_OVER = "to start over in this run directory set checkpoint.resume=none (the earlier checkpoints and metrics "\
             "are moved aside), or use another train.run_dir"


def resolve_resume(cfg: CheckpointConfig, checkpoint_dir: Path, layout: ParallelLayout | None = None
                   ) -> tuple[Path | None, list[str]]:
    """Collective over layout's world group (when distributed): the verified checkpoint to load (None for a
    fresh start), and one line for each newer checkpoint that `auto` passed over because a file failed
    verification. Raises CheckpointError, on every rank alike, when a named checkpoint fails."""
    resume = cfg.resume
    if resume == "none":
        return None, []
    if resume == "auto":
        passed_over = []
        for path in reversed(list_checkpoints(checkpoint_dir)):
            problem = verify_checkpoint(path, layout)
            if problem is None:
                return path, passed_over
            passed_over.append(f"resume: auto passed over {path}: {problem}")
        return None, passed_over
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"checkpoint.resume={resume!r} is not a directory; use none, auto or a checkpoint path "
                         f"such as {checkpoint_dir}/step_00000100")
    problem = verify_checkpoint(path, layout)
    if problem is not None:
        raise CheckpointError(problem)
    return path, []


def verify_checkpoint(path: Path, layout: ParallelLayout | None = None) -> str | None:
    """Collective: the first problem with the checkpoint at `path` (its manifest, then every file's size and
    digests, file i checked by rank i % world), the same on every rank, or None when it is good."""
    try:
        files = read_manifest(path / MANIFEST)["files"]
        rank, world = (layout.rank, layout.world_size) if layout is not None and layout.distributed else (0, 1)
        for name in sorted(files)[rank::world]:
            verify_file(path / name, files[name])
        problem = None
    except CheckpointError as err:
        problem = str(err)
    if layout is None or not layout.distributed:
        return problem
    problems: list[str | None] = [None] * layout.world_size
    dist.all_gather_object(problems, problem, group=layout.world_group)
    return next((p for p in problems if p is not None), None)


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
