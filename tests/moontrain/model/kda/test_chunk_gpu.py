"""moontrain's KDA call (moontrain.model.kda.chunk: fla's stages between moontrain's gate-and-norm kernels,
kernels.kda_gate_norm=moontrain) on one GPU: the two gate-and-norm kernels against their specification at
k3_small's heads (at their default warps (8) and at 4 and 16, which benchmarks/bench_gate_norm.py times), and the
call against fla's chunk_kda and the PyTorch KDA, with the forward's states kept and recomputed, on batch rows
and packed documents listed on the device, for the bounded and the softplus gate.

Tolerances. The kernels: as tests/moontrain/model/kda/test_gate_norm_kernel_interpreted.py derives them (sums
of <= 64 fp32 terms in another order: 2e-5 of the largest value; bf16 outputs one ulp more: 2^-7 + 2e-5).
The call: against the PyTorch KDA the bound fla's call is held to (test_layer_gpu.py: 2^-6 of the signal's
RMS); against fla's chunk_kda, which runs the same stages, the two differ only where the ends' roundings do
(an fp32 rounding, or one bf16 ulp of qn / kn / the gradients, 2^-8 of an element at most), and those
differences pass through the stages' own bf16 roundings (test_layer_gpu.py: ~8 of 2^-9): 2^-8 + 8 * 2^-9 * 2^-8
is below 2^-7, so RMS(ours - fla) <= 2^-7 RMS(fla).
"""

from __future__ import annotations

import functools

import pytest
import torch

from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.layer import fla_available
from moontrain.model.kda.ops import kda, kda_fla, random_kda_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fla_available(), reason="needs fla-core (bash ../shared/device/stage.sh fla)")]

NAMES = ("o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias")


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).square().mean().sqrt() / want.float().square().mean().sqrt()).item()


def _stage_shape(documents: bool) -> tuple[tuple[int, ...], dict]:
    """(B, T, H, K) and the chunk lists of a stage test at k3_small's heads: two rows of 1000 tokens, or one of 2000
    in one-token documents, a start on a chunk edge, and fla's use_graph padding rows at the end."""
    if not documents:
        return (2, 1000, 16, 128), {}
    cu_seqlens = torch.tensor([0, 1, 64, 65, 300, 999, 1513, 2000], device="cuda")
    chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * 5, device="cuda")])
    return (1, 2000, 16, 128), dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def _against_fla_and_the_spec(ours, recompute: bool, inputs: list, kwargs: dict, go: torch.Tensor) -> None:
    """The call `ours` (kda_fla on a moontrain route), fla's chunk_kda and the PyTorch KDA on the same inputs: the
    output and every input and parameter gradient within the module docstring's bounds of fla's and the spec's."""
    results = []
    for fn, cast in ((ours, lambda t: t), (functools.partial(kda_fla, recompute=recompute, gate_norm=False),
                                          lambda t: t), (kda, lambda t: t.float())):
        leaves = [cast(t).detach().requires_grad_() for t in inputs]
        params = [kwargs["A_log_H"].detach().requires_grad_(), kwargs["dt_bias_HK"].detach().requires_grad_()]
        o = fn(*leaves, **{**kwargs, "A_log_H": params[0], "dt_bias_HK": params[1]})
        results.append((o, *torch.autograd.grad(o, leaves + params, go.to(o.dtype))))
    ours_r, fla, spec = results
    vs_fla = {n: _rel_rms(a, b) for n, a, b in zip(NAMES, ours_r, fla, strict=True)}
    vs_spec = {n: _rel_rms(a, b) for n, a, b in zip(NAMES, ours_r, spec, strict=True)}
    assert all(e <= 2 ** -7 for e in vs_fla.values()), vs_fla
    assert all(e <= 2 ** -6 for e in vs_spec.values()), vs_spec


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded-gate", "softplus-gate"])
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("warps", [None, 4, 16], ids=["default-warps", "4-warps", "16-warps"])
def test_gate_norm_kernels_match_the_reference(lower_bound: float | None, documents: bool, warps: int | None) -> None:
    from moontrain.model.kda.gate_norm import (
        BACKWARD_OUTPUTS,
        FORWARD_OUTPUTS,
        kda_gate_norm_backward_reference,
        kda_gate_norm_reference,
        random_stage_inputs,
    )
    from moontrain.model.kda.gate_norm_kernel import kda_gate_norm, kda_gate_norm_backward

    (B, T, H, K), lists = _stage_shape(documents)
    fwd, bwd = random_stage_inputs(B, T, H, K, torch.bfloat16, "cuda", seed=0, lower_bound=lower_bound, **lists)
    # dA_log sums 2000 x 128 terms a head and dt_bias's gradient 2000: with dg >= 0 every term of either has one
    # sign (dgate >= 0; the gate's derivatives by x and A_log keep one sign where f + dt_bias < 0, all but ~0.2 %
    # of these tokens), so two fp32 summation orders differ by ~log2(n) 2^-24 of the sum (~1e-6), not by the
    # cancellation of random signs, and the 2e-5 bound holds at this size
    bwd["dg"] = bwd["dg"].abs()
    got, want = kda_gate_norm(**fwd, warps=warps), kda_gate_norm_reference(**fwd)
    states = dict(zip(("qn", "q_rstd", "kn", "k_rstd"), want[:4], strict=True))
    got_b = kda_gate_norm_backward(**bwd, **states, warps=warps)
    want_b = kda_gate_norm_backward_reference(**bwd, **states)
    for name, x, y in zip(FORWARD_OUTPUTS + BACKWARD_OUTPUTS, got + got_b, want + want_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype}"
        tol = 2 ** -7 + 2e-5 if x.dtype == torch.bfloat16 else 2e-5
        err = (x.float() - y.float()).abs().max().item()
        assert err <= tol * y.float().abs().max().item(), f"{name}: max |diff| {err:.2e}"


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded-gate", "softplus-gate"])
@pytest.mark.parametrize("doc_len", [None, 300], ids=["rows", "documents"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
def test_chunk_matches_fla_and_the_spec(lower_bound: float | None, doc_len: int | None, recompute: bool) -> None:
    B, T, H, K = 2, 1000, 16, 128  # T not a multiple of the chunk; k3_small's heads
    inputs, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=doc_len, seed=1)
    kwargs["lower_bound"] = lower_bound
    _against_fla_and_the_spec(functools.partial(kda_fla, recompute=recompute, gate_norm=True), recompute, inputs,
                              kwargs, go)


@pytest.mark.parametrize("doc_len", [None, 300], ids=["rows", "documents"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
@pytest.mark.parametrize("dqkg", ["moontrain", "fla"])
def test_chunk_with_the_fused_intra_stage_matches_fla_and_the_spec(doc_len: int | None, recompute: bool,
                                                                    dqkg: str) -> None:
    """kernels.kda_intra=moontrain (the intra-chunk stage and the norms' backward in one kernel) inside the same
    call, held to the same bounds: its off-diagonal products run in TF32 as fla's do, its diagonal ones in fp32.
    dqkg: the dqkg stage's kernel (kernels.kda_dqkg) for the whole test; moontrain's (the model's default) hands
    the fused stage dq and dk in bf16, and fla's chunk_kda then runs it too (with fp32 dq, dk)."""
    from moontrain.model.kda.fla_backend import DQKG, INTRA, route_fla_stages, routed_stages

    B, T, H, K = 2, 1000, 16, 128
    inputs, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=doc_len, seed=2)
    before = routed_stages()
    route_fla_stages(dqkg=dqkg, intra=before[INTRA])
    try:
        _against_fla_and_the_spec(functools.partial(kda_fla, recompute=recompute, gate_norm=True, intra_norm=True),
                                  recompute, inputs, kwargs, go)
    finally:
        route_fla_stages(dqkg=before[DQKG], intra=before[INTRA])


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_intra_norm_kernel_matches_the_composed_spec(documents: bool) -> None:
    """moontrain.model.kda.intra_norm_kernel at k3_small's heads against the intra stage's and the norms'
    specifications composed in float64, with the bounds tests/moontrain/model/kda/intra_norm_cases.py derives."""
    from moontrain.model.kda.intra import random_stage_inputs
    from tests.moontrain.model.kda.intra_norm_cases import OUT_TOL, reference, run, with_rstd

    (B, T, H, K), lists = _stage_shape(documents)
    for gate in (5.0, 0.1):  # the recipe's bound, and a weak gate whose terms between sub-chunks count
        x = with_rstd(random_stage_inputs(B, T, H, K, torch.bfloat16, "cuda", seed=3, gate=gate, **lists), seed=4)
        for name, a, b in zip(("dq_in", "dk_in", "db", "dg"), run(x), reference(x), strict=True):
            err = (a.double() - b.double()).abs().max().item()
            top = b.abs().max().item()
            assert err <= OUT_TOL[name] * top, f"gate {gate} {name}: max |diff| {err:.2e} vs max |ref| {top:.2e}"
