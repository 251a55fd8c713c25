"""Expert-side math kernels (moonep.kernels.glu_rows, .situ_glu, .glu_route, .route_weights,
.experts.accumulate_groups) in Triton's interpreter on the CPU, against the PyTorch specification
(moonep.activation, moonep.datapath.reference, moonep.grouped_gemm)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported (triton reads it then), installs the
# interpreter's numpy-2 shim, and skips this module too where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from tests.moonep.helpers.accumulate_cases import check_accumulate_groups, check_accumulate_groups_write
from tests.moonep.helpers.glu_route_cases import check_glu_route, glu_route_inputs
from tests.moonep.helpers.route_weight_cases import check_route_weights
from tests.moonep.helpers.situ_glu_cases import assert_bitwise, assert_close_to_exact, exact, situ_inputs


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
@pytest.mark.parametrize("F", [700, 1100, 384], ids=["one-chunk", "chunks", "128-chunks"])
def test_glu_route_kernel_matches_specification(activation: str, F: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """expert_glu's backward pass over [rows, F] with the route weights folded in: with one exp on both
    sides SiTU-GLU's outputs are bitwise the specification's; swiglu's specification takes torch.sigmoid
    (within ulps); grad_w within the derived bound (tests/moonep/helpers/glu_route_cases.py). Each tile
    choice of glu_route.backward_tiles: F <= 1024 a multiple of 128 in 128-wide chunks, other F <= 1024 in one
    masked chunk, F > 1024 over chunks with the last partial."""
    from moonep.kernels.glu_route import backward_tiles, glu_route_backward, glu_route_backward_rows

    block_f = backward_tiles(F)[1]
    assert {700: block_f >= F, 1100: F % block_f != 0, 384: block_f == 128 < F}[F]
    g, h, u, w = glu_route_inputs(activation, 37, F, "cpu")  # rows past a block
    got = glu_route_backward(activation, g, h, u, w)
    with monkeypatch.context() as m:
        m.setattr(torch, "exp", _numpy_exp)
        check_glu_route(activation, got, g, h, u, w, bitwise=activation == "situ_glu")
    # h | u as the halves of one row (expert_glu's merged gate|up output): the same values, grad_h | grad_u
    grad_hu, a_w, grad_w = glu_route_backward_rows(activation, g, torch.cat([h, u], dim=1), w)
    assert_bitwise("grad_hu", grad_hu, torch.cat(got[:2], dim=1))
    assert_bitwise("a_w (rows)", a_w, got[2])
    assert torch.equal(grad_w, got[3])
    with pytest.raises(ValueError, match="contiguous fp32 route weights"):
        glu_route_backward(activation, g, h, u, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="no kernel for activation 'gelu'"):
        glu_route_backward("gelu", g, h, u, w)
    with pytest.raises(ValueError, match=r"contiguous bf16 g \[rows, F\] and hu \[rows, 2F\]"):
        glu_route_backward_rows(activation, g, h, w)


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
@pytest.mark.parametrize("F", [300, 1100, 384], ids=["one-chunk", "chunks", "128-chunks"])
def test_glu_forward_rows_matches_specification(activation: str, F: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """a = f(h, u) on the halves of hu [rows, 2F]. SiTU-GLU with one exp on both sides: bitwise the
    specification's; swiglu (silu rounded, then the product, as F.silu(h) * u): at most 2 bf16 ulps."""
    from moonep import activation as spec
    from moonep.kernels.glu_rows import glu_forward_rows

    g = torch.Generator().manual_seed(1)
    N = 67
    hu = torch.cat([3 * torch.randn(N, F, generator=g), torch.randn(N, F, generator=g)], dim=1).to(torch.bfloat16)
    h, u = hu[:, :F], hu[:, F:]
    got = glu_forward_rows(activation, hu)
    assert got.dtype == torch.bfloat16 and got.shape == (N, F)
    if activation == "situ_glu":
        with monkeypatch.context() as m:
            m.setattr(torch, "exp", _numpy_exp)
            assert_bitwise("a", got, spec.situ_glu_forward(h, u))
    else:
        want = torch.nn.functional.silu(h) * u
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= torch.maximum(got.float().abs(), want.float().abs()) * 2 * 2.0**-7).all())
    with pytest.raises(ValueError, match=r"contiguous hu \[rows, 2F\]"):
        glu_forward_rows(activation, hu[:, 1:])
    with pytest.raises(ValueError, match="no kernel for activation 'gelu'"):
        glu_forward_rows("gelu", hu)


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_accumulate_groups_skips_empty_groups_bitwise(scale: float) -> None:
    check_accumulate_groups([3, 0, 16, 0, 0, 1], 5, 700, scale, "cpu")  # groups 1, 3, 4 empty


def test_route_weight_kernels_match_pytorch() -> None:
    check_route_weights("cpu", exact_rounding=False)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_accumulate_groups_writes_stale_groups(scale: float) -> None:
    check_accumulate_groups_write([3, 0, 16, 0, 5, 1], 3, 5, 700, scale, "cpu")  # groups 0-2 stale, 1 empty



def _numpy_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(x.numpy()))


def test_situ_glu_kernels_match_specification_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one exp on both sides (the interpreter's is numpy's) every output equals the specification's
    bit for bit: the kernels evaluate its formulas in its order with its rounding. Both are within the
    derived bound of the exact values (tests/moonep/helpers/situ_glu_cases.py)."""
    from moonep import activation as spec
    from moonep.kernels.situ_glu import situ_glu_backward, situ_glu_forward

    h, u, grad_a = situ_inputs(2)
    got_fwd, got_bwd = situ_glu_forward(h, u), situ_glu_backward(grad_a, h, u)
    with monkeypatch.context() as m:
        m.setattr(torch, "exp", _numpy_exp)
        want_fwd, want_bwd = spec.situ_glu_forward(h, u), spec.situ_glu_backward(grad_a, h, u)
    assert_bitwise("a (forward)", got_fwd, want_fwd)
    ref = exact(grad_a, h, u)
    assert_close_to_exact("a (forward)", got_fwd, ref["a"])
    for name, got, want in zip(("grad_h", "grad_u", "a"), got_bwd, want_bwd, strict=True):
        assert_bitwise(name, got, want)
        assert_close_to_exact(name, got, ref[name])
    with pytest.raises(ValueError, match="contiguous bf16 tensors of one shape"):
        situ_glu_forward(h, u.t())
    with pytest.raises(ValueError, match="contiguous bf16 tensors of one shape"):
        situ_glu_backward(grad_a.float(), h, u)


def test_every_activation_has_triton_kernels() -> None:
    """moonep.activation is the registry: the triton path fuses each registered activation."""
    from moonep.activation import ACTIVATIONS
    from moonep.kernels import glu_route, grouped_glu  # glu_rows' forward takes glu_route's ids

    assert sorted(glu_route.ACTIVATION_IDS) == sorted(grouped_glu.ACTIVATION_CODES) == sorted(ACTIVATIONS)
