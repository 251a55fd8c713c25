"""fla-core's KDA kernels in Triton's interpreter on the CPU, for tests that check moontrain's KDA call against
fla's chunk_kda where no GPU is: import it after tests.moonep.helpers.triton_interpreted; it skips the importing
module where fla-core is absent. Three shims, each for one way fla 0.6.0's kernels meet triton 3.5's interpreter
(test-only: the GPU never runs the interpreter):
- fla's autotuners run their first config (the interpreter has no timer, and fla's disk cache expects a
  compiled kernel);
- `gather` (tl.gather bound to a plain module name, which the interpreter does not patch) is a jitted wrapper;
- fla's state kernels (fla.ops.common.chunk_delta_h, whose only `range` loops are in its kernels) call `.to()`
  on a loop index of `range(n)`, which the interpreter hands out as Python ints: there `range` yields
  interpreter tensors instead.
fla's own dqkg stage (chunk_kda_bwd_wy_dqkg_fused) returns wrong gradients here on batch rows (not on packed
documents); the tests route that stage to moontrain's kernel, as the model does by default.
"""

from __future__ import annotations

import builtins

import numpy as np
import pytest

pytest.importorskip("fla")
import fla.ops.kda  # noqa: F401  (imports the KDA stages' modules)
import triton
import triton.language as tl
from fla.ops.common import chunk_delta_h as _fla_state
from fla.ops.kda import chunk_intra as _fla_intra
from fla.ops.utils import cache as _fla_cache
from triton.runtime.interpreter import TensorHandle


def _first_config_run(self, *args, **kwargs):
    self.configs = self.configs[:1]
    self.cache_results = False
    return triton.runtime.autotuner.Autotuner.run(self, *args, **kwargs)


@triton.jit
def _gather(src, index, axis: tl.constexpr):
    return tl.gather(src, index, axis)


class _TensorRange:
    """range(...) over interpreter int32 tensors (what a compiled kernel's loop index is)."""

    def __init__(self, *bounds) -> None:
        self._range = builtins.range(*(int(b) for b in bounds))

    def __iter__(self):
        for i in self._range:
            yield tl.core.tensor(TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)

    def __len__(self) -> int:
        return len(self._range)


_fla_cache.CachedAutotuner.run = _first_config_run
_fla_intra.gather = _gather
_fla_state.range = _TensorRange
