"""Triton's interpreter on the CPU, with the shims its kernels need: importing this module sets
TRITON_INTERPRET=1 (before triton decorates any kernel; spawned ranks inherit it) and skips the importing
test module where triton is absent.

Every test module that imports it is named *_interpreted.py: tests/conftest.py leaves those out on a GPU
machine, where the variable would push every kernel of the session through the interpreter
(tests/test_gpu_tier.py checks the naming). Import it first, before anything imports triton.
"""

from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel; inherited by spawned ranks
pytest.importorskip("triton.runtime.interpreter")

import moonep.triton_interpreter  # noqa: F401  (the interpreter's shims)
