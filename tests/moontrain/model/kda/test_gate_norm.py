"""moontrain.model.kda.gate_norm, the specification of KDA's gate-and-norm ends: its backward is autograd's
gradient of its forward (fp64, to fp64 rounding: 1e-10 of each gradient's largest magnitude), on batch rows
with a partial last chunk, packed documents and fla's use_graph chunk list with padding rows, for the bounded
and the softplus gate; its forward is the PyTorch KDA's gate and L2 norm (moontrain.model.kda.ops)."""

from __future__ import annotations

import math

import pytest
import torch

from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.gate_norm import (
    BACKWARD_OUTPUTS,
    kda_gate_norm_backward_reference,
    kda_gate_norm_reference,
    random_stage_inputs,
)
from moontrain.model.kda.ops import kda_gate, l2_normalize
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS


def stage_inputs(case: str, lower_bound: float | None, dtype: torch.dtype, K: int = 32,
                 seed: int = 0) -> tuple[dict, dict]:
    """The two ends' inputs for a case: batch (2 rows of 168 tokens: a partial last chunk), docs (CU_SEQLENS:
    partial chunks inside), docs_graph (docs with fla's use_graph padding rows of sequence -1)."""
    if case == "batch":
        return random_stage_inputs(2, 168, 2, K, dtype, "cpu", seed, lower_bound=lower_bound)
    cu_seqlens = torch.tensor(CU_SEQLENS)
    chunk_indices = prepare_chunk_indices(cu_seqlens)
    if case == "docs_graph":
        chunk_indices = torch.cat([chunk_indices, torch.tensor([[-1, 0]] * 3)])
    return random_stage_inputs(1, CU_SEQLENS[-1], 2, K, dtype, "cpu", seed, lower_bound=lower_bound,
                               cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("case", ["batch", "docs", "docs_graph"])
def test_backward_is_the_gradient_of_the_forward(case: str, lower_bound: float | None) -> None:
    fwd, bwd = stage_inputs(case, lower_bound, torch.float64)
    leaves = {n: fwd[n].clone().requires_grad_() for n in ("q", "k", "f", "A_log", "dt_bias")}
    leaves["A_log"] = leaves["A_log"].detach().double().requires_grad_()
    leaves["dt_bias"] = leaves["dt_bias"].detach().double().requires_grad_()
    qn, q_rstd, kn, k_rstd, g = kda_gate_norm_reference(**{**fwd, **leaves})
    # dg is the gradient of the cumulative gate in nats, g ln 2 (the module docstring)
    loss = (qn * bwd["dq"]).sum() + (kn * bwd["dk"]).sum() + (g * math.log(2) * bwd["dg"]).sum()
    want = torch.autograd.grad(loss, [leaves[n] for n in ("q", "k", "f", "A_log", "dt_bias")])
    got = kda_gate_norm_backward_reference(qn=qn.detach(), q_rstd=q_rstd, kn=kn.detach(), k_rstd=k_rstd,
                                           **{**bwd, "A_log": leaves["A_log"].detach(),
                                              "dt_bias": leaves["dt_bias"].detach()})
    for name, x, y in zip(BACKWARD_OUTPUTS, got, want, strict=True):
        assert x.shape == y.shape, f"{name}: {tuple(x.shape)} vs {tuple(y.shape)}"
        err = (x - y).abs().max().item()
        assert err <= 1e-10 * y.abs().max().item(), f"{name}: max |diff| {err:.2e}, max |grad| {y.abs().max():.2e}"


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_forward_is_the_pytorch_kdas_gate_and_norm(lower_bound: float | None) -> None:
    """qn, kn = ops.l2_normalize; g ln 2 = the per-token kda_gate summed along each chunk (batch rows: chunks of
    64 from each row's start)."""
    fwd, _ = stage_inputs("batch", lower_bound, torch.float64)
    qn, q_rstd, kn, _, g = kda_gate_norm_reference(**fwd)
    assert torch.allclose(qn, l2_normalize(fwd["q"]), rtol=0, atol=1e-14)
    assert torch.allclose(kn, l2_normalize(fwd["k"]), rtol=0, atol=1e-14)
    assert torch.allclose(q_rstd, fwd["q"].square().sum(-1).add(1e-6).rsqrt(), rtol=1e-14, atol=0)
    gate = kda_gate(fwd["f"], fwd["A_log"].double(), fwd["dt_bias"].double(), lower_bound)
    T = gate.shape[1]
    for t0 in range(0, T, 64):
        want = gate[:, t0:t0 + 64].cumsum(1)
        assert torch.allclose(g[:, t0:t0 + 64] * math.log(2), want, rtol=1e-12, atol=1e-12), f"chunk at {t0}"


def test_validation_messages() -> None:
    fwd, _ = stage_inputs("batch", -5.0, torch.float32)
    with pytest.raises(ValueError, match=r"f has shape .*\(grouped value heads are not supported\)"):
        kda_gate_norm_reference(**dict(fwd, f=torch.cat([fwd["f"]] * 2, dim=2)))
    with pytest.raises(ValueError, match=r"K=16; the head dim must be a power of two"):
        kda_gate_norm_reference(**dict(fwd, q=fwd["q"][..., :16], k=fwd["k"][..., :16], f=fwd["f"][..., :16]))
    with pytest.raises(ValueError, match=r"A_log has 3 and dt_bias 64 elements; expected 2 and 64"):
        kda_gate_norm_reference(**dict(fwd, A_log=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"packed documents \(cu_seqlens\) need batch 1, got B=2"):
        kda_gate_norm_reference(**dict(fwd, cu_seqlens=torch.tensor([0, 168])))
