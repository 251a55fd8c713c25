"""moontrain.model.kda.intra_fla (fla's intra-chunk backward kernel launched with 64-wide K-blocks,
kernels.kda_intra=fla_k64) against fla's own chunk_kda_bwd_intra (32-wide), both in Triton's interpreter on the
CPU (tests.moontrain.model.kda.fla_interpreted; skipped where fla-core is not installed), on the specification's
random stage inputs (finite values where they put NaN: fla's kernel loads some of those entries and multiplies
them by zero, which NaN survives): batch rows with a partial last chunk, packed documents with fla's use_graph
chunk list, the bounded gate at and below its bound and the unbounded one; and the route: with
kda_intra=fla_k64, fla's dispatched stage reaches this launch.

Tolerance: dq, dk and dg sum over a chunk's rows inside one program, which the K-block does not split: bitwise.
db is db_in plus the sum of the K-blocks' fp32 partials (K / 32 of them in fla's call, K / 64 here, K <= 128):
at most three additions in another grouping, each one rounding (2^-24) of a value a few times the largest |db|
at most: 1e-6 of the largest |db|.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent; then fla's shims (skips where fla-core is absent)
import tests.moonep.helpers.triton_interpreted
import tests.moontrain.model.kda.fla_interpreted  # noqa: F401
from moontrain.model.kda import intra_fla
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.fla_backend import route_fla_stages, routed_stages
from moontrain.model.kda.intra import STAGE_OUTPUTS, random_stage_inputs
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS

DB_TOL = 1e-6


def stage_inputs(case: str, K: int, at_bound: bool, safe_gate: bool) -> dict:
    if case == "batch":  # T = 80: the second chunk of each row is partial
        inputs = random_stage_inputs(2, 80, 1, K, torch.bfloat16, "cpu", seed=K, at_bound=at_bound)
    else:  # documents of 100, 30, 20 and 140 tokens, fla's use_graph list with trailing padding rows
        cu_seqlens = torch.tensor(CU_SEQLENS)
        chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * 3)])
        inputs = random_stage_inputs(1, CU_SEQLENS[-1], 1, K, torch.bfloat16, "cpu", seed=K, cu_seqlens=cu_seqlens,
                                     chunk_indices=chunk_indices, at_bound=at_bound)
        inputs["use_graph"] = True
    if not safe_gate:  # the softplus gate: fla's per-token loop instead of the factored diagonal blocks
        inputs.update(safe_gate=False, lower_bound=None)
    for name in ("dAqk", "dAkk"):  # the NaNs where moontrain's kernel must not read: finite values for fla's,
        x = inputs[name]           # which loads some of them and multiplies them by zero
        inputs[name] = torch.where(x.isnan(), torch.randn(x.shape, generator=torch.Generator().manual_seed(1)), x)
    return inputs


@pytest.fixture
def fla_routes():
    """fla's own wrapper for the stage during the test; the routing before it restored after."""
    before = routed_stages()
    route_fla_stages(dqkg=before["chunk_kda_bwd_wy_dqkg_fused"], intra="fla")
    yield
    route_fla_stages(dqkg=before["chunk_kda_bwd_wy_dqkg_fused"], intra=before["chunk_kda_bwd_intra"])


# (case, K, gates at the bound, safe gate): K = 64 is one K-block here and two in fla's call, K = 128 two and four
CASES = [("batch", 128, False, True), ("batch", 64, True, True), ("docs", 64, False, True),
         ("batch", 64, False, False)]


@pytest.mark.parametrize(("case", "K", "at_bound", "safe_gate"), CASES)
def test_wide_blocks_match_fla(case: str, K: int, at_bound: bool, safe_gate: bool, fla_routes) -> None:
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    inputs = stage_inputs(case, K, at_bound, safe_gate)
    want = chunk_kda_bwd_intra(**inputs)
    got = intra_fla.kda_intra_fla(**inputs)
    for name, x, y in zip(STAGE_OUTPUTS, got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {x.shape} vs {y.dtype} {y.shape}"
        assert torch.isfinite(x).all(), f"{name}: not finite"
        if name == "db":
            err, top = (x - y).abs().max().item(), y.abs().max().item()
            assert err <= DB_TOL * top, f"db: max |diff| {err:.2e} > {DB_TOL:.0e} x max |fla| {top:.2e}"
        else:
            assert torch.equal(x, y), f"{name}: not bitwise fla's ({(x - y).abs().max().item():.2e})"


def test_route_reaches_the_wide_launch(fla_routes, monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    inputs = stage_inputs("batch", 64, False, False)  # the unbounded gate too: fla's kernel takes every call
    calls = []
    monkeypatch.setattr(intra_fla, "kda_intra_fla", lambda **kw: calls.append(kw) or ("wide",))
    route_fla_stages(dqkg="fla", intra="fla_k64")
    assert chunk_kda_bwd_intra(**inputs) == ("wide",)
    assert len(calls) == 1 and all(calls[0][name] is x for name, x in inputs.items())
    with pytest.raises(ValueError, match=r"intra='fla_k32' \(one of \('fla', 'fla_k64'\)\)"):
        route_fla_stages(dqkg="fla", intra="fla_k32")
