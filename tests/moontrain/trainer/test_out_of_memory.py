"""A step out of GPU memory ends the run with one line (moontrain.trainer.out_of_memory): the sizes read from
torch's message, the step and the code that asked, and settings whose estimate frees the shortfall.

Reference: the message a k3_small run printed on an 80 GB H100 (kernels.short_conv=torch, auto recomputing 7
layers, step 3), and planning.memory.estimate_memory called here for each suggested setting and the one before
it; the worker's path on a k3_tiny CPU run whose step raises torch.OutOfMemoryError.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.model.params import count_params
from moontrain.parallel.layout import single_process_layout
from moontrain.planning.activations import recompute_order
from moontrain.planning.memory import estimate_memory, planned_recompute
from moontrain.trainer import worker
from moontrain.trainer.errors import one_line
from moontrain.trainer.out_of_memory import MARGIN, TrainingOutOfMemory, oom_sizes, out_of_memory_line
from moontrain.trainer.preempt import PreemptionHandler
from moontrain.trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
GiB = 2**30
H100_MESSAGE = ("CUDA out of memory. Tried to allocate 1.99 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
                "1.69 GiB is free. Including non-PyTorch memory, this process has 77.48 GiB memory in use. Of the "
                "allocated memory 59.53 GiB is allocated by PyTorch, and 1.37 GiB is reserved by PyTorch but "
                "unallocated.")


def _k3_small(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, load_recipe(REPO / "recipes/k3_small.yaml", ["parallel.ep=1", *overrides]))


def test_the_sizes_are_read_from_torchs_message() -> None:
    assert oom_sizes(H100_MESSAGE) == {"requested": 1.99 * GiB, "total": 79.18 * GiB, "free": 1.69 * GiB,
                                       "in_use": 77.48 * GiB}
    assert oom_sizes("CUDA out of memory. Tried to allocate 20.00 MiB; 512 bytes free")["requested"] == 20 * 2**20
    assert oom_sizes("out of memory") == {"requested": None, "total": None, "free": None, "in_use": None}


def test_the_recomputation_suggested_frees_the_shortfall_and_the_margin() -> None:
    cfg, have = _k3_small(), 79.18 * GiB
    counts = count_params(cfg.model)
    recomputed = planned_recompute(cfg, counts, 1, 2, have)  # auto on the H100: 7 layers
    assert len(recomputed) == 7

    def est(layers: tuple[int, ...] | list[int]) -> float:
        return estimate_memory(cfg, counts, 1, 2, layers).total

    line = out_of_memory_line(cfg, 1, 2, recomputed, 3, torch.OutOfMemoryError(H100_MESSAGE), have)
    goal = est(recomputed) - (1.99 - 1.69) * GiB - MARGIN * have
    order = recompute_order(cfg, 2)
    n = int(line.split("train.activation_checkpointing=")[1].split(" ")[0])
    assert est(order[:n]) <= goal < est(order[:n - 1]) and n > 7
    assert line.startswith("out of GPU memory in step 3 (the GPU's 79.2 GiB, 77.5 GiB in use; it asked for 2.0 GiB "
                           f"more); the launch's memory estimate was {est(recomputed) / GiB:.1f} GiB a rank with 7 of "
                           "16 layers recomputed (")
    assert f"train.activation_checkpointing={n} ({est(order[:n]) / GiB:.1f} GiB)" in line
    smaller = estimate_memory(_k3_small("train.micro_batch_size=2"), counts, 1, 2, recomputed).total
    assert f"train.micro_batch_size=2 ({smaller / GiB:.1f} GiB; the batch stays 4 sequences)" in line
    assert "optim.state_dtype" not in line  # the recipe's moments are bf16 already


def test_every_layer_recomputed_suggests_the_moments_and_a_smaller_micro_batch() -> None:
    cfg = _k3_small("optim.state_dtype=float32", "train.global_batch_size=6", "train.micro_batch_size=6")
    counts, every = count_params(cfg.model), tuple(range(16))
    line = out_of_memory_line(cfg, 1, 2, every, 1, torch.OutOfMemoryError("CUDA out of memory."), None)
    bf16 = estimate_memory(_k3_small("train.global_batch_size=6", "train.micro_batch_size=6"), counts, 1, 2,
                           every).total
    assert "activation_checkpointing=" not in line and "with every layer recomputed" in line
    assert f"optim.state_dtype=bfloat16 ({bf16 / GiB:.1f} GiB)" in line
    assert "train.micro_batch_size=3 (" in line  # the largest divisor of 6 below 6
    assert line.startswith("out of GPU memory in step 1 (the GPU's memory); ")


def test_a_launch_whose_step_runs_out_of_memory_ends_with_the_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    cfg = from_dict(RunConfig, load_recipe(REPO / "recipes/k3_tiny.yaml", [
        "parallel.ep=1", "experts.backend=local", "metrics.wandb=false", f"train.run_dir={tmp_path}",
        "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2"]))

    def step_out_of_memory(self: Trainer, defer: bool) -> list:
        if self.step == 1:
            raise torch.OutOfMemoryError(H100_MESSAGE)
        return original(self, defer)

    original = Trainer._train_step
    monkeypatch.setattr(Trainer, "_train_step", step_out_of_memory)
    handler = PreemptionHandler(rank=0)
    try:
        with pytest.raises(TrainingOutOfMemory) as err:
            worker._train_locked(cfg, torch.device("cpu"), handler, single_process_layout(torch.device("cpu")))
    finally:
        handler.uninstall()
    line = one_line(err.value, cfg.data)
    assert line is not None and line.startswith("error: out of GPU memory in step 2 at moontrain/trainer/trainer.py:")
    assert "train.micro_batch_size=1 (" in line and "activation_checkpointing=" in line
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
