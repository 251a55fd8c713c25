"""moontrain.model.kda.gate_norm_kernel's two kernels in Triton's interpreter on the CPU against the
specification (moontrain.model.kda.gate_norm, itself checked against autograd in test_gate_norm.py): batch rows
with a partial last chunk, packed documents (partial chunks), fla's use_graph chunk list with padding rows, the
bounded and the softplus gate, bf16 q/k/f read in place as column slices of a wider projection, K = 32 and 64;
the validation messages.

Tolerances, relative to each output's largest magnitude. fp32 inputs: kernel and specification differ in the
order of sums of <= 64 terms (the cumulative sums, the norms' dot products) and in the exponentials' roundings,
a few 2^-24 each: 64 * 4 * 2^-24 = 1.5e-5, rounded up to 2e-5. bf16 outputs (qn, kn, dq_in, dk_in, df): one
rounding to bf16 on top, which the two sides can take to adjacent values where the fp32 value lies near a tie:
one bf16 ulp, at most 2^-7 of the value, + 2e-5. The
partial sums dA_log and dt_bias's gradient add 2 * 168 (or 290) terms in another order: 2e-5 still covers them
at these sizes (each partial holds 64 rows).
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.kda.gate_norm import (
    BACKWARD_OUTPUTS,
    FORWARD_OUTPUTS,
    kda_gate_norm_backward_reference,
    kda_gate_norm_reference,
)
from moontrain.model.kda.gate_norm_kernel import kda_gate_cumsum, kda_gate_norm, kda_gate_norm_backward
from tests.moontrain.model.kda.test_gate_norm import stage_inputs

FP32_TOL = 2e-5
BF16_TOL = 2 ** -7 + 2e-5


def as_slices(x: torch.Tensor, others: int = 3) -> torch.Tensor:
    """x as a column slice of a [B, T, (others + 1) H K] tensor (the projection's layout): token-strided."""
    B, T, H, K = x.shape
    wide = torch.randn(B, T, (others + 1) * H * K).to(x.dtype)
    wide[..., H * K:2 * H * K] = x.reshape(B, T, H * K)
    return wide[..., H * K:2 * H * K].view(B, T, H, K)


def check(got: tuple, want: tuple, names: tuple, dtype: torch.dtype) -> None:
    for name, x, y in zip(names, got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
        assert torch.isfinite(x).all(), f"{name}: not finite"
        tol = BF16_TOL if x.dtype == torch.bfloat16 else FP32_TOL
        err = (x.float() - y.float()).abs().max().item()
        top = y.float().abs().max().item()
        assert err <= tol * top, f"{name}: max |diff| {err:.2e} > {tol:.1e} x max |ref| {top:.2e}"


# (case, q/k/f dtype, K, gate's lower bound, inputs as slices of a projection)
CASES = [("batch", torch.float32, 32, -5.0, False),
         ("batch", torch.bfloat16, 64, None, True),
         ("docs", torch.float32, 32, None, False),
         ("docs_graph", torch.bfloat16, 32, -5.0, True)]


@pytest.mark.parametrize(("case", "dtype", "K", "lower_bound", "sliced"), CASES)
def test_kernels_match_the_reference(case: str, dtype: torch.dtype, K: int, lower_bound: float | None,
                                     sliced: bool) -> None:
    fwd, bwd = stage_inputs(case, lower_bound, dtype, K=K, seed=K)
    if sliced:
        fwd = dict(fwd, **{n: as_slices(fwd[n]) for n in ("q", "k", "f")})
        bwd = dict(bwd, f=fwd["f"])
        assert not fwd["f"].is_contiguous()
    got = kda_gate_norm(**fwd)
    want = kda_gate_norm_reference(**fwd)
    if case == "docs_graph":  # the padding rows list no token: every token is still in a listed chunk
        assert torch.isfinite(got[-1]).all()
    check(got, want, FORWARD_OUTPUTS, dtype)
    states = dict(zip(("qn", "q_rstd", "kn", "k_rstd"), want[:4], strict=True))
    check(kda_gate_norm_backward(**bwd, **states), kda_gate_norm_backward_reference(**bwd, **states),
          BACKWARD_OUTPUTS, dtype)


def test_validation_messages() -> None:
    fwd, bwd = stage_inputs("batch", -5.0, torch.float32)
    states = dict(zip(("qn", "q_rstd", "kn", "k_rstd"), kda_gate_norm_reference(**fwd)[:4], strict=True))
    with pytest.raises(ValueError, match=r"kda_gate_norm: f has shape"):
        kda_gate_norm(**dict(fwd, f=torch.cat([fwd["f"]] * 2, dim=2)))
    with pytest.raises(ValueError, match=r"dq is not contiguous"):
        kda_gate_norm_backward(**dict(bwd, dq=bwd["dq"].transpose(1, 2).contiguous().transpose(1, 2)), **states)
    with pytest.raises(ValueError, match=r"dq, dk, dg, q_rstd and k_rstd must be fp32 on the kernel"):
        kda_gate_norm_backward(**dict(bwd, dg=bwd["dg"].double()), **states)
    with pytest.raises(ValueError, match=r"warps must be a power of two in \[1, 32\], got 3"):
        kda_gate_norm(**fwd, warps=3)


def test_gate_alone_is_the_forwards_g_bit_for_bit() -> None:
    """kda_gate_cumsum (the backward's recompute of g, kernels.kda_recompute) is kda_gate_norm's g bitwise, on
    device-listed documents with f a column slice."""
    fwd, _ = stage_inputs("docs_graph", -5.0, torch.bfloat16)
    f = as_slices(fwd["f"])
    g = kda_gate_norm(**dict(fwd, f=f))[-1]
    assert torch.equal(kda_gate_cumsum(f, fwd["A_log"], fwd["dt_bias"], lower_bound=-5.0, cu_seqlens=fwd["cu_seqlens"],
                                       chunk_indices=fwd["chunk_indices"]), g)
