"""train.deterministic: the switches it sets, and that the training path runs under torch's deterministic
mode (which raises on any op without a deterministic implementation) with two runs bitwise equal, on
one process and on 2 ranks with moonep. The GPU check (two k3_small runs and a stop/resume through
`moontrain launch`, bitwise, and the step-time cost) is benchmarks/check_determinism.py.

Reference: a second identical run (bitwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.determinism import determinism_state
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")


@pytest.fixture
def restore_switches() -> Iterator[None]:
    import torch._inductor.config as inductor_config

    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.cuda.cudnn_sdp_enabled(), inductor_config.deterministic,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    torch.backends.cuda.enable_cudnn_sdp(saved[3])
    inductor_config.deterministic = saved[4]
    if saved[5] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _deterministic(run_dir: Path, backend: str = "local", ep: int = 1) -> object:
    cfg = small_config(backend, ep, run_dir=str(run_dir))
    cfg.train.deterministic = True
    return cfg


def test_deterministic_sets_the_switches_and_two_runs_match(tmp_path: Path, restore_switches: None) -> None:
    torch.set_num_threads(2)  # CPU index_put_(accumulate) is threaded (and unordered) unless deterministic
    first = Trainer(_deterministic(tmp_path), single_process_layout(CPU))
    assert determinism_state() == {"deterministic_algorithms": True, "cudnn_deterministic": True,
                                   "cudnn_sdp": False, "inductor_deterministic": True}
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    train(first, 3)
    second = Trainer(_deterministic(tmp_path), single_process_layout(CPU))
    train(second, 3)
    assert_bitwise(full_state(second), full_state(first), "two deterministic runs")


def _two_runs(rank: int, world: int, run_dir: str) -> None:
    states = []
    for _ in range(2):
        trainer = Trainer(_deterministic(Path(run_dir), "moonep", 2), build_layout(2, CPU))
        train(trainer, 2)
        states.append(full_state(trainer))
        trainer.close()
    assert_bitwise(states[1], states[0], f"rank {rank}: two deterministic moonep runs")


@pytest.mark.slow
def test_deterministic_moonep_ep2(tmp_path: Path) -> None:
    run_ranks(_two_runs, 2, str(tmp_path))
