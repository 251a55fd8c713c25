"""moontrain.model.kda.dqkg_kernel's Triton kernels in Triton's interpreter on the CPU against the
specification kda_dqkg_reference (itself checked against autograd in test_kda_dqkg.py): batch rows,
packed documents (partial chunks inside them), fla's use_graph chunk list with padding rows, fp32 and bf16,
and the validation messages.

Tolerances, relative to each output's largest magnitude. fp32: the kernel and the specification compute the
same fp32 products and differ in summation order only: a few 2^-24 per term over contractions of <= 64 + 64
terms, chained three deep for dA: 2e-5. bf16 inputs (exact in the fp32 specification): dq is fp32 products of
bf16 values (exact) summed in fp32: 2e-5; dv2 is rounded to bf16 once (an ulp, 2^-7 of a value): 2^-7 + 2e-5;
dk, dg, db and dA pass through up to three bf16 roundings of fp32 operands (dw, kg, and the two dA
products, 2^-9 each, as fla does) summed over <= 64 terms of either sign; allowing the terms' absolute sum
4x the largest output: 4 * 3 * 2^-9 = 2.3e-2 (these cases measure <= 9e-3).
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.kda import dqkg_kernel as kda_dqkg_kernel
from moontrain.model.kda.dqkg import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda.dqkg import kda_dqkg_reference, prepare_chunk_indices
from moontrain.model.kda.dqkg import random_stage_inputs as stage_inputs
from moontrain.model.kda.dqkg_kernel import kda_dqkg
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS

FP32_TOL = 2e-5
BF16_TOL = {"dq": 2e-5, "dv2": 2 ** -7 + 2e-5, "dk": 2.3e-2, "dg": 2.3e-2, "db": 2.3e-2, "dA": 2.3e-2}


def use_tiles(monkeypatch: pytest.MonkeyPatch, BK: int, BV: int, finish_BV: int) -> None:
    """One config per kernel: the autotuner runs it without timing (the interpreter has no timer)."""
    config = kda_dqkg_kernel.triton.Config
    monkeypatch.setattr(kda_dqkg_kernel._kblock_tuned, "configs", [config({"BK": BK, "BV": BV})])
    monkeypatch.setattr(kda_dqkg_kernel._finish_tuned, "configs", [config({"BV": finish_BV})])


def check(inputs: dict, dtype: torch.dtype) -> None:
    got = kda_dqkg(**inputs)
    want = kda_dqkg_reference(**inputs)
    for name, x, y in zip(OUTPUTS, got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {x.shape} != {y.dtype} {y.shape}"
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL[name]
        err = (x.float() - y.float()).abs().max().item()
        top = y.float().abs().max().item()
        assert err <= tol * top, f"{name}: max |diff| {err:.2e} > {tol:.1e} x max |ref| {top:.2e}"


# (case, dtype, K, V, kernel tiles (BK, BV, finish BV)): BK = 32 < K splits dA and db over two K-block
# partials, BV < V loops over V blocks in both kernels
CASES = [("batch", torch.float32, 64, 64, (32, 32, 32)),
         ("batch", torch.float32, 64, 32, (64, 32, 32)),
         ("docs", torch.float32, 64, 64, (32, 32, 64)),
         ("docs_graph", torch.float32, 32, 64, (32, 32, 32)),
         ("docs", torch.bfloat16, 64, 64, (32, 32, 32)),
         ("batch", torch.bfloat16, 64, 64, (64, 64, 32))]


@pytest.mark.parametrize(("case", "dtype", "K", "V", "tiles"), CASES)
def test_kernel_matches_reference(case: str, dtype: torch.dtype, K: int, V: int, tiles: tuple[int, int, int],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    use_tiles(monkeypatch, *tiles)
    if case == "batch":  # T = 160: the last chunk of each row is partial
        inputs = stage_inputs(2, 160, 2, K, V, dtype, "cpu", seed=K + V)
    else:  # documents of 100 (a partial second chunk), 30, 20 and 140 tokens (a partial third chunk)
        cu_seqlens = torch.tensor(CU_SEQLENS)
        chunk_indices = prepare_chunk_indices(cu_seqlens)
        if case == "docs_graph":  # fla's use_graph: trailing rows of sequence -1, to be skipped
            chunk_indices = torch.cat([chunk_indices, torch.tensor([[-1, 0]] * 3)])
        inputs = stage_inputs(1, CU_SEQLENS[-1], 2, K, V, dtype, "cpu", seed=K + V, cu_seqlens=cu_seqlens,
                              chunk_indices=chunk_indices)
        inputs["use_graph"] = case == "docs_graph"
    check(inputs, dtype)


def test_dq_dk_in_q_dtype_are_the_fp32_ones_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """dqk_dtype=q's dtype (the fused intra route's): dq and dk are the fp32 call's values rounded once (within one
    bf16 ulp of each: the interpreter's conversion truncates, torch's rounds to nearest; subnormal fp32 values within
    2^-126), every other output bit for bit the fp32 call's; any other dtype is refused."""
    use_tiles(monkeypatch, 32, 32, 32)
    inputs = stage_inputs(2, 160, 2, 64, 64, torch.bfloat16, "cpu", seed=5)
    wide, low = kda_dqkg(**inputs), kda_dqkg(**inputs, dqk_dtype=torch.bfloat16)
    for name, x, y in zip(OUTPUTS, low, wide, strict=True):
        if name in ("dq", "dk"):
            assert x.dtype == torch.bfloat16, name
            bound = (2 ** -7 * y.abs()).clamp(min=2 ** -126)  # subnormals: the interpreter's own flushing
            assert ((x.float() - y).abs() <= bound).all(), f"{name}: more than one bf16 ulp off"
        else:
            assert torch.equal(x, y), name
    with pytest.raises(ValueError, match=r"dqk_dtype=torch.float16; give torch.float32 or q's dtype"):
        kda_dqkg(**inputs, dqk_dtype=torch.float16)


def test_validation_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    use_tiles(monkeypatch, 32, 32, 32)
    inputs = stage_inputs(1, 64, 2, 32, 32, torch.float32, "cpu", seed=0)
    grouped = dict(inputs, v=torch.cat([inputs["v"]] * 2, dim=2))
    with pytest.raises(ValueError, match=r"v has 4 heads and k 2; grouped value heads \(GVA\) are not supported"):
        kda_dqkg(**grouped)
    with pytest.raises(ValueError, match=r"state_v_first=True is not supported"):
        kda_dqkg(**inputs, state_v_first=True)
    with pytest.raises(ValueError, match=r"K=48; head dims must be powers of two in \[32, 256\]"):
        kda_dqkg(**stage_inputs(1, 64, 2, 48, 32, torch.float32, "cpu", seed=0))
    with pytest.raises(ValueError, match=r"packed documents \(cu_seqlens\) need batch 1, got B=2"):
        kda_dqkg(**dict(stage_inputs(2, 64, 2, 32, 32, torch.float32, "cpu", seed=0),
                        cu_seqlens=torch.tensor([0, 64])))
