"""Per-rank entry point started by torchrun: `python -m moontrain.trainer.worker RECIPE [key=value ...]`.

Picks nccl on GPU and gloo on CPU, builds the layout, writes the resolved config (rank 0), resumes from the
latest checkpoint unless checkpoint.resume says otherwise (moontrain.checkpoint.resume), opens the wandb run
(rank 0; the id comes from the checkpoint on resume, so the same run continues), trains and prints the
end-of-run summary.

A configuration or data error (ValueError) ends the worker with one line on stderr, `moontrain: error: ...`,
and exit status 2; under `moontrain launch` that line is also written to the file named by the
MOONTRAIN_ERROR_FILE environment variable, which the launcher prints instead of torchrun's report.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moontrain.checkpoint.resume import START_OVER, set_aside_earlier_run
from moontrain.checkpoint.resume import resolve_resume as resolve_checkpoint
from moontrain.checkpoint.tensors import CheckpointError
from moontrain.config import RunConfig, dump_config, from_dict, load_recipe
from moontrain.config.loader import to_dict
from moontrain.metrics.progress import ProgressLog
from moontrain.metrics.wandb_run import WandbRun
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer


def select_device() -> tuple[torch.device, str]:
    """This torchrun rank's device and process-group backend: its GPU and nccl, else the CPU and gloo
    (with the cores split between the local ranks)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return torch.device("cpu"), "gloo"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m moontrain.trainer.worker RECIPE [key=value ...] (started by torchrun)")
    try:
        cfg = from_dict(RunConfig, load_recipe(argv[0], argv[1:]))
    except ValueError as err:
        report_error(err)
    device, backend = select_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        train(cfg, device)
    except ValueError as err:
        report_error(err)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cfg: RunConfig, device: torch.device) -> None:
    layout = build_layout(cfg.parallel.ep, device)
    cfg.check_world(layout.world_size)
    is_main = layout.rank == 0
    if is_main:
        dump_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
        print(f"moontrain: {layout.describe()}; experts backend {cfg.experts.backend}; device {device}", flush=True)
    trainer = Trainer(cfg, layout)
    sink = None
    try:
        resume_from = resolve_resume(cfg, trainer.checkpoint_dir)
        if resume_from is not None:
            try:
                trainer.load_checkpoint(resume_from)
            except CheckpointError as err:
                raise CheckpointError(f"{err}; {START_OVER}") from err
            if is_main:
                print(f"moontrain: resumed from {resume_from} at step {trainer.step}", flush=True)
        elif is_main and cfg.checkpoint.resume == "none":
            moved = set_aside_earlier_run(trainer.checkpoint_dir, Path(cfg.train.run_dir))
            if moved is not None:
                print(f"moontrain: checkpoint.resume=none: starting over; the earlier run's checkpoints are in "
                      f"{moved}", flush=True)
        if is_main:
            if cfg.metrics.wandb:
                sink = WandbRun(cfg.metrics, run_dir=cfg.train.run_dir, config=to_dict(cfg),
                                run_id=trainer.wandb_run_id)
                trainer.wandb_run_id = sink.id
            trainer.log = ProgressLog(cfg.train.run_dir, cfg.train.steps, sink=sink, start_step=trainer.step)
        trainer.fit()
        if trainer.log is not None:
            print(trainer.log.summary(step=trainer.step, tokens_seen=trainer.tokens_seen,
                                      checkpoint=trainer.last_checkpoint,
                                      wandb_dir=sink.sync_dir if sink is not None else None), flush=True)
    finally:
        if trainer.log is not None:
            trainer.log.close()
        trainer.close()


def report_error(err: ValueError) -> None:
    """One line for the user (and for the launcher, through MOONTRAIN_ERROR_FILE); exit status 2."""
    line = f"moontrain: error: {err}".replace("\n", " ")
    path = os.environ.get("MOONTRAIN_ERROR_FILE")
    if path:
        try:
            with open(path, "x") as fh:  # the first rank to fail wins; the others' lines are usually the same
                fh.write(line + "\n")
        except FileExistsError:
            pass
    else:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)


def resolve_resume(cfg: RunConfig, checkpoint_dir: Path) -> Path | None:
    """checkpoint.resume: auto -> the latest complete checkpoint (None if there is none); none -> None;
    otherwise the named directory, which must exist."""
    return resolve_checkpoint(cfg.checkpoint, checkpoint_dir)


if __name__ == "__main__":
    main()
