"""The CuTe DSL planner kernel (experiments.cute_planner.cute_planner) traces and compiles to sm_90a PTX and
cubin on a machine without a GPU, and its entry point rejects bad problems with a ValueError.

CuTe DSL runs its whole MLIR pipeline (PTX, then ptxas) without a driver; only loading the module
needs one. `no_jit_engine=True` stops before that load, so this runs on a CPU host (GPUArch picks
the target instead of the detected GPU). Bitwise values are checked on the GPU by
experiments/cute_planner/test_cute_planner_gpu.py; here the PTX is checked for the kernel's synchronisation
structure (five CTA barriers, one __syncwarp in the quota split), warp reductions and the absence of
local memory (no spills, no indexed register arrays)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")
cuda = pytest.importorskip("cuda.bindings.driver")

# (R, E, B, token_padding): R = 1, the training shape E = 384 with B = epn and fewer slots, an odd
# epn, alloc in global memory (R = 16, E = 768), and R > 32 with alloc in global and in shared memory
SHAPES = [(1, 8, 8, 1), (2, 384, 192, 16), (2, 384, 100, 1), (3, 9, 3, 4), (8, 384, 20, 16), (16, 768, 48, 16),
          (64, 1024, 16, 16), (64, 64, 1, 1)]


@pytest.mark.parametrize(("R", "E", "B", "pad"), SHAPES)
def test_cute_planner_compiles_to_sm90a(R: int, E: int, B: int, pad: int, tmp_path: Path) -> None:
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir, GPUArch, KeepPTX

    from experiments.cute_planner.cute_planner import NUM_THREADS, PlanSharedKernel, example_args

    kernel = PlanSharedKernel(R, E, B, pad)
    compiled = cute.compile[GPUArch("sm_90a"), KeepPTX, DumpDir(str(tmp_path))](
        kernel, *example_args(R, E, B, "cpu"), cuda.CUstream(0), no_jit_engine=True)
    assert "@kernels_binary" in str(compiled.ir_module), "no cubin embedded in the compiled module"
    ptx = compiled.artifacts.PTX
    assert ptx and list(tmp_path.glob("*.sm_90a.ptx")), f"no PTX dumped into {tmp_path}"
    assert ".target sm_90a" in ptx
    assert f".reqntid {NUM_THREADS}, 1, 1" in ptx
    counts = {name: len(re.findall(pattern, ptx)) for name, pattern in (
        ("bar.sync", r"\bbar\.sync\b"), ("bar.warp.sync", r"\bbar\.warp\.sync\b"), ("redux.sync", r"\bredux\.sync\b"),
        ("vote.ballot", r"\bvote\.sync\.ballot\b"), ("local", r"\.local\b"))}
    assert counts["bar.sync"] == 5, counts
    assert counts["bar.warp.sync"] == 1, counts
    assert counts["redux.sync"] >= (5 if R == 1 else 9), counts  # phase C folds away at R = 1
    assert counts["vote.ballot"] >= 1, counts
    assert counts["local"] == 0, counts
    assert kernel.alloc_in_smem == ((R, E) not in ((16, 768), (64, 1024))), kernel.smem_bytes


@pytest.mark.parametrize(("counts", "cap", "B", "pad", "match"), [
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 4, 1, "one CUDA device"),
    (torch.zeros(2, 7, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 4, 1, "E divisible by R, got R=2, E=7"),
    (torch.zeros(65, 65, dtype=torch.int32), torch.zeros(65, dtype=torch.int64), 1, 1, "1 <= R <= 64"),
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), 4, 1, r"cap_R must be \[R\] = \[2\]"),
    (torch.zeros(8, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 4, 1, r"counts_RE must be \[R, E\]"),
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 0, 1, "num_slots and token_padding"),
])
def test_cute_planner_rejects_bad_problems(counts: torch.Tensor, cap: torch.Tensor, B: int, pad: int,
                                           match: str) -> None:
    from experiments.cute_planner.cute_planner import plan_shared

    with pytest.raises(ValueError, match=match):
        plan_shared(counts, cap, B, pad)
