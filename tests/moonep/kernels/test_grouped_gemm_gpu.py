"""The fused expert GEMMs (moonep.kernels.grouped_glu, .grouped_wgrad) on one GPU at expert shapes of
k3_small_moe (H 2048, F 1024) and K3 (latent H 3584, F 3072), with ragged and empty groups, against exact
values and the PyTorch path with the bounds tests/moonep/helpers/grouped_gemm_cases.py derives."""

from __future__ import annotations

import pytest

from tests.moonep.helpers.grouped_gemm_cases import check_grouped_glu, check_grouped_wgrad

pytestmark = pytest.mark.gpu

# empty groups first, in the middle and last; one tile and many row tiles; multiples of 16 as moonep pads
# them (torch._grouped_mm's wgrad needs multiples of 8); RAGGED: any sizes, against exact values only
ROWS = [0, 704, 0, 16, 2048, 48, 0, 336, 1536, 0]
RAGGED = [0, 1, 700, 0, 333, 2047, 5, 0]
SHAPES = [(2048, 1024), (3584, 3072)]  # (H, F): k3_small_moe, K3


@pytest.mark.parametrize(("H", "F"), SHAPES)
@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_grouped_glu_gpu(H: int, F: int, activation: str) -> None:
    check_grouped_glu(ROWS, H, F, activation, "cuda")


@pytest.mark.parametrize(("I", "O"), [*SHAPES, (1024, 2048)])  # gate/up (H, F) and down (F, H)
@pytest.mark.parametrize(("scale", "write_groups"), [(1.0, 0), (1 / 3, 5)])
def test_grouped_wgrad_gpu(I: int, O: int, scale: float, write_groups: int) -> None:
    check_grouped_wgrad(ROWS, I, O, scale, write_groups, "cuda")


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_grouped_glu_ragged_gpu(activation: str) -> None:
    check_grouped_glu(RAGGED, 2048, 1024, activation, "cuda", torch_path=False)


def test_grouped_wgrad_ragged_gpu() -> None:
    check_grouped_wgrad(RAGGED, 2048, 1024, 0.5, 2, "cuda", torch_path=False)
