"""moontrain.model.kda.intra_norm_kernel (the intra-chunk stage and the L2 norms' backward in one kernel,
kernels.kda_intra=moontrain) in Triton's interpreter on the CPU against its specification, the two stages
composed in float64: moontrain.model.kda.intra's reference (itself checked against autograd in test_intra.py),
then the norms' part of moontrain.model.kda.gate_norm's backward reference. Batch rows with a partial last
chunk, packed documents on fla's use_graph chunk list (padding rows), gates at the lower bound (the widest
exponents a bounded gate allows) and spread below it, K = 32, 64 and 128 (one, two and four sub-chunks of whole
columns); the gate's backward alone against the gate-and-norm kernel's; the refusals.

Tolerances: tests/moontrain/model/kda/intra_norm_cases.py derives them.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.gate_norm_kernel import kda_gate_backward, kda_gate_norm_backward
from moontrain.model.kda.intra import random_stage_inputs
from moontrain.model.kda.intra_norm_kernel import kda_intra_norm
from tests.moontrain.model.kda.intra_norm_cases import OUT_TOL, TF32_TOL, reference, run, with_rstd
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS
from tests.moontrain.model.kda.test_gate_norm import stage_inputs as gate_stage_inputs
from tests.moontrain.model.kda.test_gate_norm_kernel_interpreted import FP32_TOL


def inputs(case: str, K: int, gate: float, at_bound: bool, dtype: torch.dtype = torch.bfloat16) -> dict:
    if case == "batch":  # T = 160: the third chunk of each row is partial (32 rows: two sub-chunks)
        x = random_stage_inputs(2, 160, 2, K, dtype, "cpu", seed=K, gate=gate, at_bound=at_bound)
    else:  # documents of 100, 30, 20 and 140 tokens, fla's use_graph list with trailing padding rows
        cu_seqlens = torch.tensor(CU_SEQLENS)
        chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * 3)])
        x = random_stage_inputs(1, CU_SEQLENS[-1], 2, K, dtype, "cpu", seed=K, cu_seqlens=cu_seqlens,
                                chunk_indices=chunk_indices, gate=gate, at_bound=at_bound)
        x["use_graph"] = True
    return with_rstd(x, seed=K + 1)


# (case, K, the gate's bound, gates at the bound, q / k dtype). At the recipe's bound (5 nats a token) the terms
# between sub-chunks are ~e^-40 of the diagonal's; a weak gate (0.1) makes them count. fp32 q and k give fp32
# dq_in, dk_in (no rounding on the way out).
CASES = [("batch", 32, 5.0, True, torch.bfloat16), ("batch", 64, 0.1, False, torch.bfloat16),
         ("docs", 64, 5.0, True, torch.bfloat16), ("docs", 128, 0.1, False, torch.bfloat16),
         ("docs", 64, 0.1, False, torch.float32), ("batch", 32, 5.0, False, torch.float32)]


@pytest.mark.parametrize(("case", "K", "gate", "at_bound", "dtype"), CASES)
def test_kernel_matches_the_composed_specification(case: str, K: int, gate: float, at_bound: bool,
                                                   dtype: torch.dtype) -> None:
    x = inputs(case, K, gate, at_bound, dtype)
    got, want = run(x), reference(x)
    for name, a, b in zip(("dq_in", "dk_in", "db", "dg"), got, want, strict=True):
        assert a.dtype == (dtype if name in ("dq_in", "dk_in") else torch.float32), name
        assert torch.isfinite(a).all(), f"{name}: not finite"
        tol = OUT_TOL[name] if a.dtype == torch.bfloat16 else TF32_TOL
        err = (a.double() - b.double()).abs().max().item()
        top = b.abs().max().item()
        assert err <= tol * top, f"{name}: max |diff| {err:.2e} > {tol:.1e} x max |ref| {top:.2e}"


@pytest.mark.parametrize("case", ["batch", "docs"])
def test_kernel_takes_dq_dk_in_q_dtype(case: str) -> None:
    """dq and dk as moontrain's dqkg stage hands them on the fused route (q's dtype, not fp32): the kernel against
    the specification on those same rounded values, at the fp32 inputs' bounds."""
    x = inputs(case, 64, 0.1, False)
    x["dq"], x["dk"] = x["dq"].to(torch.bfloat16), x["dk"].to(torch.bfloat16)
    got, want = run(x), reference(x)
    for name, a, b in zip(("dq_in", "dk_in", "db", "dg"), got, want, strict=True):
        err, top = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= OUT_TOL[name] * top, f"{name}: max |diff| {err:.2e} > {OUT_TOL[name]:.1e} x max |ref| {top:.2e}"
    with pytest.raises(ValueError, match=r"dq is torch.float16; the stage takes the dqkg stage's fp32 gradients or "
                                         r"q's dtype \(torch.bfloat16\)"):
        run(dict(x, dq=x["dq"].half()))
    with pytest.raises(ValueError, match=r"dq is torch.float64 and dk torch.bfloat16; give them in fp32 or q's dtype"):
        run(dict(x, dq=x["dq"].double()))


@pytest.mark.parametrize("K", [32, 128])  # one column block a chunk, four
def test_gate_backward_alone_is_the_gate_norm_kernels_gate_part(K: int) -> None:
    """kda_gate_backward (the gate-and-norm backward with its norms off, its programs split over column blocks)
    against the whole kernel on device-listed documents: df and dt_bias's gradient bit for bit (each column's sums
    in the same order), dA_log (a sum over every column, grouped per program) within the gate-and-norm tests' fp32
    bound for sums taken in another order."""
    _, bwd = gate_stage_inputs("docs_graph", -5.0, torch.bfloat16, K=K, seed=3)
    B, T, H, K = bwd["dq"].shape
    qn = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(torch.bfloat16)
    rstd = torch.rand(B, T, H) + 0.5
    whole = kda_gate_norm_backward(**bwd, qn=qn, q_rstd=rstd, kn=qn, k_rstd=rstd)
    gate = {n: bwd[n] for n in ("dg", "f", "A_log", "dt_bias", "lower_bound", "cu_seqlens", "chunk_indices")}
    df, dA_log, ddt_bias = kda_gate_backward(**gate)
    assert torch.equal(df, whole[2]), "df"
    assert torch.equal(ddt_bias, whole[4]), "ddt_bias"
    err, top = (dA_log - whole[3]).abs().max().item(), whole[3].abs().max().item()
    assert err <= FP32_TOL * top, f"dA_log: max |diff| {err:.2e} > {FP32_TOL:.0e} x max |ref| {top:.2e}"


def test_refusals() -> None:
    from moontrain.model.kda.chunk import chunk_kda_moontrain

    q = torch.randn(1, 64, 2, 32)
    with pytest.raises(ValueError, match=r"gate lower bound in \[-10.0, 0\).*got model.kda_gate_lower_bound=None"):
        chunk_kda_moontrain(q, q, q, q, torch.rand(1, 64, 2), torch.zeros(2), torch.zeros(64), scale=1.0,
                            lower_bound=None, intra_norm=True)  # refused before the forward runs anything
    x = inputs("batch", 32, 5.0, False)
    with pytest.raises(ValueError, match=r"gate lower bound in \[-10.0, 0\).*kda_intra=fla_k64"):
        kda_intra_norm(*(x[n] for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg", "q_rstd",
                                         "k_rstd")), lower_bound=None)
    with pytest.raises(ValueError, match=r"dq is not contiguous"):
        kda_intra_norm(*(x[n] if n != "dq" else x[n].transpose(1, 2).contiguous().transpose(1, 2)
                         for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg", "q_rstd",
                                   "k_rstd")), lower_bound=-5.0)


def test_register_cap() -> None:
    """The launch's maxnreg: the shipped cap at K <= 128, uncapped at K = 256 or for 0, a bad cap refused."""
    from moontrain.model.kda.intra_norm_kernel import MAXNREG, _register_cap

    assert MAXNREG * 4 * 32 * 3 <= 65536 < MAXNREG * 4 * 32 * 4  # three programs of 4 warps an SM, not four
    assert _register_cap(None, 128) == {"maxnreg": MAXNREG} and _register_cap(None, 64) == {"maxnreg": MAXNREG}
    assert _register_cap(None, 256) == {} and _register_cap(0, 128) == {}
    assert _register_cap(200, 256) == {"maxnreg": 200}
    for bad in (-8, 100, 32):
        with pytest.raises(ValueError, match=f"maxnreg={bad}"):
            _register_cap(bad, 128)
