"""Test tiers: plain `pytest` is the CPU tier; `gpu` and `multigpu` tests skip without the hardware.

The markers are registered in pyproject.toml. One GPU: `python -m pytest -m "gpu or multigpu" tests/` (the
multigpu tests skip); two: the same under `torchrun --nproc_per_node=2` (README).

Layout: tests/ mirrors the packages (tests/moonep/planner tests moonep/planner, and so on); what several
tests share sits in one helpers module per package (tests/moonep/helpers/). A GPU test is marked, and the
marker alone decides its tier: `@pytest.mark.gpu` (one CUDA GPU) or `@pytest.mark.multigpu` (two or more,
under torchrun), as a module's `pytestmark` when every test of the module needs it. There is no GPU folder:
a GPU test sits beside the CPU tests of the code it checks, in a module named test_<subject>_gpu.py or
test_<subject>_multigpu.py when all of its tests need the device (a CPU module may mark single tests).

Fixture `one_rank` (here, for every package's single-GPU tests): this process as a one-rank NCCL group, per
module (or the group already initialised, if it has one rank).

Without a GPU, conftest sets TRITON_INTERPRET=1 before any test module imports triton: the CPU tier runs
Triton's kernels in its interpreter, and every test then sees what it sees in the whole run.

On a machine with a CUDA GPU two things differ from the CPU tier:
- modules named `*_interpreted.py` (at any depth) are not collected. They run the Triton kernels in Triton's
  interpreter on the CPU and set TRITON_INTERPRET=1 at import, before triton reads it, which would push
  every kernel of the session through the interpreter. tests/test_gpu_tier.py checks that every
  module which sets it, itself or through what it imports, is so named.
- fla's autotune choices for the KDA heads the GPU tests use (recipes/data/fla_autotune_h200, its README) are
  copied into Triton's cache where missing, as a run's worker does (moontrain.trainer.kernel_cache): without
  them a fresh machine searches fla's tile configurations for minutes per shape before the first KDA call
  returns.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ON_GPU = torch.cuda.is_available()
INTERPRETED_SUFFIX = "_interpreted.py"
if not ON_GPU:
    # The CPU tier runs Triton's kernels in its interpreter: every *_interpreted.py module sets TRITON_INTERPRET=1
    # at import, and in a whole run it holds for every test. Set here, before any test module imports triton, it
    # holds from the start in any selection too: triton imported without it (test_compile.py collected first)
    # broke the interpreter's calls of nested @triton.jit helpers in the interpreted tests run after it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if ON_GPU and collection_path.name.endswith(INTERPRETED_SUFFIX):
        return True
    return None  # no opinion: pytest's other rules decide


def pytest_sessionstart(session: pytest.Session) -> None:
    if ON_GPU and importlib.util.find_spec("fla") is not None:
        from moontrain.trainer.kernel_cache import seed_shipped_fla

        seed_shipped_fla(torch.device("cuda"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = torch.cuda.device_count() if ON_GPU else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs on one host, {num_gpus} visible")
    for item in items:
        if item.get_closest_marker("gpu") is not None and num_gpus == 0:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") is not None and num_gpus < 2:
            item.add_marker(skip_multigpu)


@pytest.fixture(scope="module")
def one_rank() -> dist.ProcessGroup:
    """This process as a one-rank NCCL group (or the group already initialised, if it has one rank)."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a one-GPU test; the torchrun tests cover several ranks")
        yield dist.group.WORLD
        return
    torch.cuda.set_device(0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()
