"""Test tiers: plain `pytest` is the CPU tier; `gpu` and `multigpu` tests skip without the hardware.

The markers are registered in pyproject.toml. Multi-GPU tests run under
`torchrun --nproc_per_node=2 -m pytest -m multigpu tests/` (see README).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs on one host, {num_gpus} visible")
    for item in items:
        if item.get_closest_marker("gpu") is not None and num_gpus == 0:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") is not None and num_gpus < 2:
            item.add_marker(skip_multigpu)

# On a GPU machine the Triton kernels run natively (tests/moonep/gpu); the *_interpreted modules set
# TRITON_INTERPRET=1 at import, which would push every kernel of the session through the interpreter.
collect_ignore_glob = ["moonep/*_interpreted.py", "moontrain/*_interpreted.py"] if torch.cuda.is_available() else []
