"""train.deterministic: the switches it sets on the CPU and on CUDA (torch's strict flag only on the CPU, or
when asked for), the refusal of an fla autotune cache that is off, and two CPU runs bitwise equal on one
process and on 2 ranks with moonep (the CPU runs under the strict flag, which raises on any op without a
deterministic implementation). GPU: test_determinism_gpu.py, and benchmarks/check_determinism.py (two
k3_small runs and a stop/resume through `moontrain launch`, bitwise, the step-time cost, a profile).

Reference: a second identical run (bitwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.determinism import determinism_state, enable_determinism
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")


@pytest.fixture
def restore_switches() -> Iterator[None]:
    import torch._inductor.config as inductor_config

    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, inductor_config.deterministic, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    inductor_config.deterministic = saved[3]
    if saved[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _deterministic(run_dir: Path, backend: str = "local", ep: int = 1) -> object:
    cfg = small_config(backend, ep, run_dir=str(run_dir))
    cfg.train.deterministic = True
    return cfg


def test_deterministic_sets_the_switches_and_two_runs_match(tmp_path: Path, restore_switches: None) -> None:
    torch.set_num_threads(2)  # CPU index_put_(accumulate) is threaded (and unordered) unless deterministic
    first = Trainer(_deterministic(tmp_path), single_process_layout(CPU))
    assert determinism_state() == {"deterministic_algorithms": True, "cudnn_deterministic": True,
                                   "cudnn_benchmark": False, "inductor_deterministic": True, "cublas_workspace": True}
    assert first.model.deterministic_attention
    train(first, 3)
    second = Trainer(_deterministic(tmp_path), single_process_layout(CPU))
    train(second, 3)
    assert_bitwise(full_state(second), full_state(first), "two deterministic runs")


def test_cuda_switches_leave_the_strict_flag_off(restore_switches: None) -> None:
    """On CUDA deterministic mode sets no torch-wide deterministic algorithms (their fallbacks are what
    cost); strict=True does (the checker mode)."""
    torch.use_deterministic_algorithms(False)
    enable_determinism(torch.device("cuda"))  # sets switches only: no CUDA needed
    assert determinism_state() == {"deterministic_algorithms": False, "cudnn_deterministic": True,
                                   "cudnn_benchmark": False, "inductor_deterministic": True, "cublas_workspace": True}
    enable_determinism(torch.device("cuda"), strict=True)
    assert determinism_state()["deterministic_algorithms"]


def test_fla_autotune_cache_off_is_refused(restore_switches: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLA_CACHE_RESULTS", "0")
    enable_determinism(torch.device("cuda"))  # no fla kernels in the model: nothing to check
    with pytest.raises(ValueError, match=r"FLA_CACHE_RESULTS='0'; unset it"):
        enable_determinism(torch.device("cuda"), kda_fla=True)


def test_default_mode_sets_nothing(tmp_path: Path, restore_switches: None) -> None:
    torch.use_deterministic_algorithms(False)
    trainer = Trainer(small_config("local", 1, run_dir=str(tmp_path)), single_process_layout(CPU))
    assert not trainer.model.deterministic_attention
    assert not torch.are_deterministic_algorithms_enabled()


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
