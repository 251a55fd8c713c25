"""moontrain.model.kda.intra_fwd_kernel (KDA's forward intra-chunk stage in one kernel) in Triton's interpreter on
the CPU: against its specification (moontrain.model.kda.intra_fwd, float64) and against fla-core's
chunk_kda_fwd_intra (its three kernels, in the interpreter too; skipped without fla), on batch rows with a partial
last chunk and on packed documents with fla's use_graph padding rows; gates at the safe gate's bound; the
refusals.

Tolerances. Against the specification (unrounded float64): every output is stored in bf16 (2^-9 relative), and
w and u are formed, as fla forms them, from Akk, beta k 2^g and beta v each rounded to bf16 first: at most four
such roundings, 2^-7 of the signal's RMS. Against fla: the same values from other factorings of the exponentials
(anchored at the key's sub-chunk) and another order of the inverse's products, each rounded to bf16: at least
99 % of the elements bitwise fla's and the rest within one bf16 ulp of the largest (2^-7 of it). At the bound
(every gate at -5 nats a token) fla's off-diagonal key factors overflow, so only the specification is compared.
"""

from __future__ import annotations

import sys

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent; then fla's shims (the stage's first launch is fla's kernel; skips without fla-core)
import tests.moonep.helpers.triton_interpreted
import tests.moontrain.model.kda.fla_interpreted  # noqa: F401
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.intra_fwd import (
    STAGE_OUTPUTS,
    kda_intra_forward_reference,
    on_or_below_diagonal,
    random_intra_forward_inputs,
)
from moontrain.model.kda.intra_fwd_kernel import kda_intra_forward
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS

PADDING_ROWS = 3


def inputs(case: str, K: int, V: int, at_bound: bool = False) -> dict:
    if case == "batch":  # T = 160: the third chunk of each row holds 32 tokens
        return random_intra_forward_inputs(2, 160, 2, K, V, torch.bfloat16, "cpu", seed=K + V, at_bound=at_bound)
    cu_seqlens = torch.tensor(CU_SEQLENS)  # documents of 100, 30, 20 and 140 tokens
    chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * PADDING_ROWS)])
    return random_intra_forward_inputs(1, CU_SEQLENS[-1], 2, K, V, torch.bfloat16, "cpu", seed=K + V,
                                       cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, at_bound=at_bound)


# (case, K, V, the kernel's K-block, value block, gates at the bound)
CASES = [("batch", 64, 32, 32, 32, False), ("docs", 32, 64, 16, 32, False), ("batch", 32, 32, 32, 16, True)]


@pytest.mark.parametrize(("case", "K", "V", "bk", "bv", "at_bound"), CASES)
def test_kernel_matches_the_specification(case: str, K: int, V: int, bk: int, bv: int, at_bound: bool) -> None:
    x = inputs(case, K, V, at_bound)
    got = kda_intra_forward(**x, bk=bk, bv=bv)
    x64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in x.items()}
    want = kda_intra_forward_reference(**x64)
    for name, a, b in zip(STAGE_OUTPUTS, got, want, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert torch.isfinite(a).all(), f"{name}: not finite"
        rms = ((a.double() - b).square().mean().sqrt() / b.square().mean().sqrt()).item()
        assert rms <= 2 ** -7, f"{name}: RMS of the difference {rms:.2e} > 2^-7 of the specification's"
    # zero above the diagonals (the walk and the backward read the lower parts), Akk's diagonal one
    Aqk, Akk, cu = got[4], got[5], x["cu_seqlens"]
    assert not Aqk.masked_select(~on_or_below_diagonal(Aqk, cu)).any(), "Aqk: not zero above its diagonal"
    assert not Akk.masked_select(~on_or_below_diagonal(Akk, cu)).any(), "Akk: not zero above its diagonal"
    diag = Akk.masked_select(on_or_below_diagonal(Akk, cu) & ~on_or_below_diagonal(Akk, cu, strict=True))
    assert torch.equal(diag, torch.ones_like(diag)), "Akk: its diagonal is not one"


@pytest.mark.parametrize(("case", "K", "V", "bk", "bv"), [c[:5] for c in CASES if not c[5]])
def test_kernel_matches_flas_three_kernels(case: str, K: int, V: int, bk: int, bv: int) -> None:
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

    x = inputs(case, K, V)
    got = kda_intra_forward(**x, bk=bk, bv=bv)
    ref = chunk_kda_fwd_intra(q=x["q"], k=x["k"], v=x["v"], gk=x["g"], beta=x["beta"], scale=x["scale"],
                              cu_seqlens=x["cu_seqlens"], chunk_indices=x["chunk_indices"], safe_gate=True,
                              disable_recompute=True, use_graph=case == "docs")
    for name, a, b in zip(STAGE_OUTPUTS, got, ref, strict=True):
        if name == "Aqk":  # fla leaves the blocks above the diagonal unwritten
            keep = on_or_below_diagonal(a, x["cu_seqlens"])
            a, b = a.masked_fill(~keep, 0), b.masked_fill(~keep, 0)
        diff = (a.float() - b.float()).abs()
        same = (diff == 0).float().mean().item()
        assert same >= 0.99, f"{name}: {same:.2%} of the elements bitwise fla's"
        top = b.float().abs().max().item()
        assert diff.max().item() <= 2 ** -7 * top, f"{name}: max |diff| {diff.max().item():.2e} > 2^-7 x {top:.2e}"


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    x = inputs("batch", 32, 32)
    with monkeypatch.context() as m:  # fla-core absent: its kernel is the first launch
        m.setitem(sys.modules, "fla.ops.kda.chunk_intra", None)
        with pytest.raises(ValueError, match="install fla-core"):
            kda_intra_forward(**x)
    with pytest.raises(ValueError, match="bk=24 must divide K=32"):
        kda_intra_forward(**x, bk=24, bv=32)
    with pytest.raises(ValueError, match="v has shape"):
        kda_intra_forward(**{**x, "v": x["v"][:, :100]})
    with pytest.raises(ValueError, match="k is not contiguous"):
        kda_intra_forward(**{**x, "k": x["k"].transpose(1, 2).contiguous().transpose(1, 2)})
    with pytest.raises(ValueError, match="g must be fp32"):
        kda_intra_forward(**{**x, "g": x["g"].bfloat16()})
    with pytest.raises(ValueError, match="powers of two"):
        kda_intra_forward(**{**x, "v": torch.zeros(*x["v"].shape[:3], 48, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="need batch 1"):
        kda_intra_forward(**{**x, "cu_seqlens": torch.tensor([0, 160])})
    with pytest.raises(ValueError, match="need chunk_indices"):
        kda_intra_forward(**{**x, "q": x["q"][:1], "k": x["k"][:1], "v": x["v"][:1], "g": x["g"][:1],
                             "beta": x["beta"][:1], "cu_seqlens": torch.tensor([0, 160])}, bv=32)
