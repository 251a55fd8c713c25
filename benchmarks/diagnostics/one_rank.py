"""The recipe's trainer on one GPU at EP = 1, for the diagnostics that time a trainer's steps (optimizer_overlap,
graph_capture; each started by `torchrun --nproc_per_node=1`): the process group around a run, and the trainer."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer


def recipe_parser(doc: str | None) -> argparse.ArgumentParser:
    """The diagnostic's command line: --recipe and the recipe's key=value overrides (parallel.ep=1 is added)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/k3_small.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides (parallel.ep=1 is added)")
    return p


def on_one_gpu(script: str, run: Callable[[torch.device], None]) -> None:
    """run(device) inside an NCCL process group of this one rank (a SystemExit naming `script` without a GPU)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    try:
        run(device)
    finally:
        dist.destroy_process_group()


def one_rank_trainer(recipe: str, overrides: list[str], steps: int, device: torch.device) -> Trainer:
    """The recipe's trainer with `overrides`, at EP = 1, for `steps` steps, in a new temporary run folder."""
    overrides = [*overrides, "parallel.ep=1", f"train.run_dir={tempfile.mkdtemp(prefix='diagnostic_')}",
                 f"train.steps={steps}"]
    return Trainer(from_dict(RunConfig, load_recipe(recipe, overrides)), build_layout(1, device))
