"""moontrain.model.kda.intra_kernel's Triton kernel in Triton's interpreter on the CPU against the specification
kda_intra_reference (itself checked against autograd in test_kda_intra.py): batch rows with a partial last
chunk, packed documents (partial chunks and partial 16-row blocks inside them), fla's use_graph chunk list with
padding rows, K-blocks narrower than K, gates at their bound (the widest exponent range), bf16 q/k; the
NaNs random_stage_inputs puts where the stage must not read stay out of the results; the validation messages.

Tolerance, relative to each output's largest magnitude: the interpreter's products are fp32 (no TF32), so
kernel and specification differ in summation order and in the kernel's factored exponentials 2^(g_i - a)
2^(a - g_j) (two roundings where the specification has one, a few 2^-24 each) over sums of <= 64 terms of
either sign plus the incoming gradient: 64 * 4 * 2^-24 = 1.5e-5, rounded up to 2e-5. bf16 q/k are exact in
the fp32 specification, so the same bound holds.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.kda import intra_kernel as kda_intra_kernel
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.intra import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda.intra import kda_intra_reference, random_stage_inputs
from moontrain.model.kda.intra_kernel import kda_intra
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS

TOL = 2e-5


def use_tile(monkeypatch: pytest.MonkeyPatch, BK: int) -> None:
    """One config: the autotuner runs it without timing (the interpreter has no timer)."""
    monkeypatch.setattr(kda_intra_kernel._intra_tuned, "configs", [kda_intra_kernel.triton.Config({"BK": BK})])


# (case, q/k dtype, K, BK, gates at the bound)
CASES = [("batch", torch.float32, 64, 32, False),
         ("batch", torch.float32, 32, 32, True),
         ("docs", torch.float32, 64, 64, True),
         ("docs_graph", torch.float32, 32, 32, False),
         ("docs", torch.bfloat16, 64, 32, False)]


@pytest.mark.parametrize(("case", "dtype", "K", "BK", "at_bound"), CASES)
def test_kernel_matches_reference(case: str, dtype: torch.dtype, K: int, BK: int, at_bound: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    use_tile(monkeypatch, BK)
    if case == "batch":  # T = 168: the last chunk of each row is partial (40 rows: two full blocks and 8 rows)
        inputs = random_stage_inputs(2, 168, 2, K, dtype, "cpu", seed=K, at_bound=at_bound)
    else:  # documents of 100 (a partial second chunk), 30, 20 and 140 tokens (a partial third chunk)
        cu_seqlens = torch.tensor(CU_SEQLENS)
        chunk_indices = prepare_chunk_indices(cu_seqlens)
        if case == "docs_graph":  # fla's use_graph: trailing rows of sequence -1, to be skipped
            chunk_indices = torch.cat([chunk_indices, torch.tensor([[-1, 0]] * 3)])
        inputs = random_stage_inputs(1, CU_SEQLENS[-1], 2, K, dtype, "cpu", seed=K, cu_seqlens=cu_seqlens,
                                     chunk_indices=chunk_indices, at_bound=at_bound)
        inputs["use_graph"] = case == "docs_graph"
    got = kda_intra(**inputs)
    want = kda_intra_reference(**inputs)
    for name, x, y in zip(OUTPUTS, got, want, strict=True):
        assert x.dtype == torch.float32 and x.shape == y.shape, f"{name}: {x.dtype} {x.shape} vs {y.shape}"
        assert torch.isfinite(x).all(), f"{name}: not finite"
        err = (x - y).abs().max().item()
        top = y.abs().max().item()
        assert err <= TOL * top, f"{name}: max |diff| {err:.2e} > {TOL:.0e} x max |ref| {top:.2e}"


def test_validation_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    use_tile(monkeypatch, 32)
    inputs = random_stage_inputs(1, 64, 2, 32, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"safe_gate=False \(an unbounded gate\)"):
        kda_intra(**dict(inputs, safe_gate=False))
    with pytest.raises(ValueError, match=r"grouped value heads \(GVA\) are not supported"):
        kda_intra(**dict(inputs, g=torch.cat([inputs["g"]] * 2, dim=2)))
    with pytest.raises(ValueError, match=r"dq is not contiguous"):
        kda_intra(**dict(inputs, dq=inputs["dq"].transpose(1, 2).contiguous().transpose(1, 2)))
    with pytest.raises(ValueError, match=r"dq, dk, db and dg must be fp32 on the kernel"):
        kda_intra(**dict(inputs, dg=inputs["dg"].double()))
