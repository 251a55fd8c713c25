"""Per-rank entry point started by torchrun: `python -m moontrain.trainer.worker RECIPE [key=value ...]`.

Picks nccl on GPU and gloo on CPU, builds the layout, writes the resolved config (rank 0) and trains.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moontrain.config import RunConfig, dump_config, from_dict, load_recipe
from moontrain.metrics.progress import ProgressLog
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m moontrain.trainer.worker RECIPE [key=value ...] (started by torchrun)")
    cfg = from_dict(RunConfig, load_recipe(argv[0], argv[1:]))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        layout = build_layout(cfg.parallel.ep, device)
        cfg.check_world(layout.world_size)
        is_main = layout.rank == 0
        if is_main:
            dump_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
            print(f"moontrain: {layout.describe()}; experts backend {cfg.experts.backend}; device {device}",
                  flush=True)
        trainer = Trainer(cfg, layout, log=ProgressLog(cfg.train.run_dir, cfg.train.steps) if is_main else None)
        try:
            trainer.fit()
        finally:
            trainer.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
