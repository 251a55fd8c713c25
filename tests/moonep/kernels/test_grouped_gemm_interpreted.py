"""The fused expert GEMMs (moonep.kernels.grouped_glu, .grouped_wgrad) in Triton's interpreter on the CPU,
against exact values and the PyTorch path with the bounds tests/moonep/helpers/grouped_gemm_cases.py derives.
Ragged groups: empty ones first, in the middle and last, one row, several row tiles; H, F, I, O not
multiples of the interpreter's 16-wide tiles; NaN rows past offs[-1] (never read)."""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and installs the interpreter's shims
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from tests.moonep.helpers.grouped_gemm_cases import check_grouped_glu, check_grouped_wgrad

ROWS = [0, 5, 0, 37, 1, 0, 16, 0]


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_grouped_glu_matches_pytorch_path(activation: str) -> None:
    check_grouped_glu(ROWS, 40, 56, activation, "cpu")


@pytest.mark.parametrize(("scale", "write_groups"), [(1.0, 0), (1 / 3, 0), (0.5, 4)])
def test_grouped_wgrad_accumulates_into_fp32(scale: float, write_groups: int) -> None:
    check_grouped_wgrad(ROWS, 40, 56, scale, write_groups, "cpu")


def test_grouped_wgrad_all_groups_stale() -> None:
    check_grouped_wgrad([3, 0, 20], 24, 16, 1.0, 3, "cpu")


def test_grouped_gemm_bad_input() -> None:
    from moonep.kernels.grouped_glu import grouped_glu_forward
    from moonep.kernels.grouped_wgrad import grouped_wgrad_accumulate

    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    w = torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        grouped_glu_forward(x, w, offs, "gelu")
    with pytest.raises(ValueError, match=r"contiguous bf16 tensors on one device, got x_rows torch\.float32"):
        grouped_glu_forward(x.float(), w, offs)
    with pytest.raises(ValueError, match=r"w_gate_up \[G, H, 2F\]"):
        grouped_glu_forward(x, w[:, :, :7].contiguous(), offs)
    with pytest.raises(ValueError, match=r"w_gate_up \[G, H, 2F\]"):
        grouped_glu_forward(x, w[:, :8].contiguous(), offs)
    with pytest.raises(ValueError, match=r"offs int32 \[G = 2\]"):
        grouped_glu_forward(x, w, offs.long())
    g = torch.zeros(2, 16, 32)
    with pytest.raises(ValueError, match="contiguous fp32 grad"):
        grouped_wgrad_accumulate(g.double(), x, torch.zeros(8, 32, dtype=torch.bfloat16), offs)
    with pytest.raises(ValueError, match=r"grad_rows contiguous bf16 \[N, 32\]"):
        grouped_wgrad_accumulate(g, x, torch.zeros(8, 16, dtype=torch.bfloat16), offs)
    with pytest.raises(ValueError, match=r"write_groups must be in \[0, 2\]"):
        grouped_wgrad_accumulate(g, x, torch.zeros(8, 32, dtype=torch.bfloat16), offs, write_groups=3)


def _fused_moe_rank(rank: int, world: int, E: int, maxvio: float, activation: str) -> dict:
    import moonep.buffer as buffer_module
    from moonep import BufferOptions
    from tests.moonep.test_moe_layer import _rank_fn

    # the triton path is CUDA-only by design; force it onto the CPU heap for the interpreter
    buffer_module.resolve_kernels = lambda kernels, device: "triton"
    return _rank_fn(rank, world, E, maxvio, activation, BufferOptions(fused_expert_gemm=True, num_sms=3))


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_moe_layer_with_fused_expert_gemms_matches_dense_reference(activation: str) -> None:
    """expert_glu on the triton path with BufferOptions.fused_expert_gemm, 2 ranks with redundant experts,
    within the derived tolerance of tests/moonep/test_moe_layer.py."""
    from tests.moonep.test_moe_layer import check_against_dense_reference

    check_against_dense_reference(_fused_moe_rank, 2, activation)

