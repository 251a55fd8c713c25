"""moontrain.model.kda.intra (kda_intra_reference, the specification of the stage) against autograd, on the CPU in
fp64.

The stage adds the gradients that flow through KDA's two intra-chunk matrices (test_kda_dqkg.kda_matrices: Aqk,
here with scale 1 as fla's dAqk carries the scale, and Lm, the strictly lower matrix the WY form inverts) to the
dqkg stage's: for loss = <dAqk, Aqk(q, k, G)> + <dAkk, Lm(k, G, beta)>, autograd's gradients of q, k, beta and G
plus the incoming dq, dk, db, dg are the stage's outputs (in fla's log2 units G / ln 2 is the input g; dg stays
the gradient of G, as in the dqkg stage). Entries the stage must not read are NaN in its inputs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moontrain.model.kda.dqkg import CHUNK, prepare_chunk_indices
from moontrain.model.kda.intra import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda.intra import kda_intra_reference, random_stage_inputs, validate
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS, chunk_local_cumsum, kda_matrices


def sequences(case: str) -> tuple[int, int, list[tuple[int, int, int]], torch.Tensor | None]:
    if case == "batch":
        return 2, 160, [(b, 0, 160) for b in range(2)], None  # chunks of 64, 64, 32 per row
    seqs = [(0, a, e) for a, e in itertools.pairwise(CU_SEQLENS)]
    return 1, CU_SEQLENS[-1], seqs, torch.tensor(CU_SEQLENS)


@pytest.mark.parametrize("case", ["batch", "docs", "docs_graph"])
def test_reference_is_the_gradient_through_the_matrices(case: str) -> None:
    """kda_intra_reference(fp64) == the incoming gradients + autograd's through Aqk and Lm, to fp64 rounding
    (1e-10 of each output's largest value: the same sums in different orders)."""
    torch.manual_seed(0)
    H, K = 2, 64
    B, T, seqs, cu_seqlens = sequences(case)
    f64 = torch.float64
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=f64), dim=-1)
    beta = torch.rand(B, T, H, dtype=f64)
    g_raw = -torch.rand(B, T, H, K, dtype=f64) * 0.5
    G = chunk_local_cumsum(g_raw, seqs)
    leaves = [x.clone().requires_grad_() for x in (q, k, G, beta)]
    Lm, Aqk = kda_matrices(*leaves[:3], leaves[3], seqs, scale=1.0)
    dAqk, dAkk = torch.randn_like(Aqk), torch.randn_like(Lm)
    ((Aqk * dAqk).sum() + (Lm * dAkk).sum()).backward()

    # what the stage must not read: above the diagonal (on it, for dAkk) and past each chunk's end
    pos = torch.full((B, T), CHUNK)
    size = torch.zeros((B, T), dtype=torch.long)
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, CHUNK):
            t1 = min(t0 + CHUNK, eos)
            pos[b, t0:t1] = torch.arange(t1 - t0)
            size[b, t0:t1] = t1 - t0
    col, pos, size = torch.arange(CHUNK), pos[:, :, None, None], size[:, :, None, None]
    dAqk_in = torch.where((col <= pos) & (col < size), dAqk, math.nan)
    dAkk_in = torch.where((col < pos) & (col < size), dAkk, math.nan)
    base = dict(dq=torch.randn(B, T, H, K, dtype=f64), dk=torch.randn(B, T, H, K, dtype=f64),
                db=torch.randn(B, T, H, dtype=f64), dg=torch.randn(B, T, H, K, dtype=f64))
    chunk_indices = None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens)
    if case == "docs_graph":  # fla's use_graph chunk list: padding rows of sequence -1, to be skipped
        chunk_indices = torch.cat([chunk_indices, torch.tensor([[-1, 0], [-1, 0]])])
    got = kda_intra_reference(q=q, k=k, g=G / math.log(2), beta=beta, dAqk=dAqk_in, dAkk=dAkk_in, **base,
                              cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, safe_gate=True,
                              use_graph=case == "docs_graph")
    want = [base[n] + leaf.grad for n, leaf in zip(("dq", "dk", "dg", "db"), leaves, strict=True)]
    want = [want[0], want[1], want[3], want[2]]  # OUTPUTS order: dq, dk, db, dg
    for name, x, y in zip(OUTPUTS, got, want, strict=True):
        assert x.dtype == f64 and x.shape == y.shape, name
        err = (x - y).abs().max().item()
        assert err <= 1e-10 * y.abs().max().item(), f"{name}: max |diff| {err:.2e}, max |grad| {y.abs().max():.2e}"


def test_random_inputs_mark_what_is_not_read() -> None:
    """random_stage_inputs' NaNs sit exactly where the specification does not read: its outputs are finite, and
    a NaN moved onto a read entry (the diagonal of dAqk) reaches them."""
    cu_seqlens = torch.tensor(CU_SEQLENS)
    inputs = random_stage_inputs(1, CU_SEQLENS[-1], 2, 32, torch.float32, "cpu", seed=0, cu_seqlens=cu_seqlens,
                                 chunk_indices=prepare_chunk_indices(cu_seqlens))
    assert all(torch.isfinite(x).all() for x in kda_intra_reference(**inputs))
    assert torch.isnan(inputs["dAqk"]).any() and torch.isnan(inputs["dAkk"]).any()
    inputs["dAqk"][0, 5, 1, 5] = math.nan
    assert torch.isnan(kda_intra_reference(**inputs)[0][0, 5, 1]).any()


def test_validation_messages() -> None:
    inputs = random_stage_inputs(1, 64, 2, 32, torch.float32, "cpu", seed=0)
    args = [inputs[n] for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg")]
    with pytest.raises(ValueError, match=r"grouped value heads \(GVA\) are not supported"):
        validate(*args[:2], torch.cat([inputs["g"]] * 2, dim=2), *args[3:], None, CHUNK)
    with pytest.raises(ValueError, match=r"chunk_size=32; the kernel takes chunk_size=64"):
        validate(*args, None, 32)
    with pytest.raises(ValueError, match=r"dq is torch.bfloat16; the stage takes the dqkg stage's fp32"):
        validate(*args[:6], inputs["dq"].bfloat16(), *args[7:], None, CHUNK)
    with pytest.raises(ValueError, match=r"dAkk has shape \(1, 64, 2, 32\), expected \(1, 64, 2, 64\)"):
        validate(*args[:5], inputs["dAkk"][..., :32], *args[6:], None, CHUNK)
    wide = random_stage_inputs(1, 64, 2, 48, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"K=48; the head dim must be a power of two in \[32, 256\]"):
        validate(*[wide[n] for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg")], None, CHUNK)
