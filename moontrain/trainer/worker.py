"""Per-rank entry point started by torchrun: `python -m moontrain.trainer.worker RECIPE [key=value ...]`.

Picks nccl on GPU and gloo on CPU, builds the layout, writes the resolved config (rank 0), resumes from a
checkpoint when checkpoint.resume says so, opens the wandb run (rank 0; the id comes from the checkpoint
on resume) and trains.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moontrain.checkpoint import find_latest
from moontrain.config import RunConfig, dump_config, from_dict, load_recipe
from moontrain.config.loader import to_dict
from moontrain.metrics.progress import ProgressLog
from moontrain.metrics.wandb_run import WandbRun
from moontrain.parallel.hosts import check_ep_group_hosts
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
    cfg = from_dict(RunConfig, load_recipe(argv[0], argv[1:]))
    device, backend = select_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        layout = build_layout(cfg.parallel.ep, device)
        cfg.check_world(layout.world_size)
        check_ep_group_hosts(layout.ep_group, cfg.experts.backend)
        is_main = layout.rank == 0
        if is_main:
            dump_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
            print(f"moontrain: {layout.describe()}; experts backend {cfg.experts.backend}; device {device}",
                  flush=True)
        trainer = Trainer(cfg, layout)
        try:
            resume_from = resolve_resume(cfg, trainer.checkpoint_dir)
            if resume_from is not None:
                trainer.load_checkpoint(resume_from)
                if is_main:
                    print(f"moontrain: resumed from {resume_from} at step {trainer.step}", flush=True)
            if is_main:
                sink = None
                if cfg.metrics.wandb:
                    sink = WandbRun(cfg.metrics, run_dir=cfg.train.run_dir, config=to_dict(cfg),
                                    run_id=trainer.wandb_run_id)
                    trainer.wandb_run_id = sink.id
                trainer.log = ProgressLog(cfg.train.run_dir, cfg.train.steps, sink=sink,
                                          append=resume_from is not None)
            trainer.fit()
        finally:
            if trainer.log is not None:
                trainer.log.close()
            trainer.close()
    finally:
        dist.destroy_process_group()


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
