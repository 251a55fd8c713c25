"""Per-rank entry point started by torchrun: `python -m moontrain.trainer.worker RECIPE [key=value ...]`.

Picks nccl on GPU and gloo on CPU, builds the layout, writes the resolved config (rank 0), resumes from a
checkpoint when checkpoint.resume says so, opens the wandb run (rank 0; the id comes from the checkpoint
on resume) and trains.

Faults: the process group fails a collective after parallel.timeout_s; heartbeats (parallel.heartbeat)
name a dead or frozen rank in every survivor's error; SIGTERM / SIGINT finish the step, save and exit 0
(trainer.preempt); the rank dies with torchrun. User errors (settings, data, checkpoints, divergence)
are one line `moontrain: rank R: error: ...` (trainer.errors); anything else keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from moontrain.checkpoint import find_latest
from moontrain.checkpoint.store import incomplete_after, optim_changes
from moontrain.config import RunConfig, dump_config, from_dict, load_recipe
from moontrain.config.loader import to_dict
from moontrain.metrics.progress import ProgressLog
from moontrain.metrics.wandb_run import WandbRun
from moontrain.parallel.heartbeat import Heartbeat
from moontrain.parallel.layout import build_layout
from moontrain.supervisor import die_with_parent
from moontrain.trainer.determinism import set_cublas_workspace
from moontrain.trainer.errors import one_line
from moontrain.trainer.preempt import PreemptionHandler
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
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = from_dict(RunConfig, load_recipe(argv[0], argv[1:]))
    except ValueError as err:
        _exit_one_line(rank, f"error: {err}")
    die_with_parent()  # torchrun gone (killed with the launcher): no rank keeps training
    preemption = PreemptionHandler(rank)
    if cfg.train.deterministic:
        set_cublas_workspace()  # read when CUDA initialises
    device, backend = select_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=cfg.parallel.timeout_s))
    heartbeat = None
    if dist.get_world_size() > 1 and cfg.parallel.heartbeat_timeout_s > 0:
        heartbeat = Heartbeat(_default_store(), dist.get_rank(), dist.get_world_size(),
                              timeout_s=cfg.parallel.heartbeat_timeout_s).start()
    try:
        _train(cfg, device, preemption)
    except Exception as err:
        line = one_line(err, cfg.data)
        culprit = heartbeat.diagnose() if heartbeat is not None and line is None else None
        if line is None:
            traceback.print_exc()
            line = f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        _exit_one_line(rank, line + (f"; {culprit}" if culprit else ""))
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        preemption.uninstall()
        dist.destroy_process_group()


def _exit_one_line(rank: int, line: str) -> NoReturn:
    print(f"moontrain: rank {rank}: {line}", file=sys.stderr, flush=True)
    sys.exit(1)


def _default_store() -> dist.Store:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _train(cfg: RunConfig, device: torch.device, preemption: PreemptionHandler) -> None:
    layout = build_layout(cfg.parallel.ep, device)
    cfg.check_world(layout.world_size)
    is_main = layout.rank == 0
    if is_main:
        dump_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
        print(f"moontrain: {layout.describe()}; experts backend {cfg.experts.backend}; device {device}"
              + ("; deterministic kernels" if cfg.train.deterministic else ""), flush=True)
    trainer = Trainer(cfg, layout)
    trainer.preemption = preemption
    try:
        resume_from = resolve_resume(cfg, trainer.checkpoint_dir)
        if resume_from is not None:
            state = trainer.load_checkpoint(resume_from)
            notes = resume_notes(cfg, trainer.checkpoint_dir, resume_from, state)
            if is_main:
                print(f"moontrain: resumed from {resume_from} at step {trainer.step}", flush=True)
                for note in notes:
                    print(f"moontrain: {note}", flush=True)
        if is_main:
            sink = None
            if cfg.metrics.wandb:
                sink = WandbRun(cfg.metrics, run_dir=cfg.train.run_dir, config=to_dict(cfg),
                                run_id=trainer.wandb_run_id)
                trainer.wandb_run_id = sink.id
            trainer.log = ProgressLog(cfg.train.run_dir, cfg.train.steps, sink=sink,
                                      append=resume_from is not None)
        trainer.fit()
        if trainer.stop_requested and is_main:
            print(f"moontrain: stopped by {preemption.signal_name or 'a signal to another rank'} after step "
                  f"{trainer.step} of {cfg.train.steps}; checkpoint saved in {trainer.checkpoint_dir}; continue "
                  "with checkpoint.resume=auto", flush=True)
    finally:
        if trainer.log is not None:
            trainer.log.close()
        trainer.close()


def resume_notes(cfg: RunConfig, checkpoint_dir: Path, resumed: Path, state: dict) -> list[str]:
    """What a resume changes or passes over, one line each; raises when the run has nothing left to do
    below the checkpoint's step."""
    step = state["step"]
    if step > cfg.train.steps:
        raise ValueError(f"checkpoint {resumed} is at step {step}, past train.steps={cfg.train.steps}: raise "
                         f"train.steps above {step} to train on, or set checkpoint.resume=none to start afresh")
    notes = []
    if cfg.checkpoint.resume == "auto":
        notes += [f"resume: auto passed over {p} (incomplete: an interrupted save or missing files)"
                  for p in incomplete_after(checkpoint_dir, resumed)]
    changes = optim_changes(state, cfg.optim)
    if changes:
        notes.append("optim settings differ from the checkpoint's; the recipe's apply from here: " + ", ".join(changes))
    if step == cfg.train.steps:
        notes.append(f"checkpoint is at train.steps={cfg.train.steps} already: nothing to train")
    return notes


def resolve_resume(cfg: RunConfig, checkpoint_dir: Path) -> Path | None:
    """checkpoint.resume: none -> None; auto -> the latest complete checkpoint (None if there is none);
    otherwise the named directory, which must exist."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(checkpoint_dir)
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"checkpoint.resume={resume!r} is not a directory; use none, auto or a checkpoint path "
                         f"such as {checkpoint_dir}/step_00000100")
    return path


if __name__ == "__main__":
    main()
