"""moontrain.model.kda.walk_kernel (KDA's forward state walk and output in one kernel) in Triton's interpreter on
the CPU: against its specification (moontrain.model.kda.walk, float64) and against fla-core's two kernels it
replaces (chunk_gated_delta_rule_fwd_h then chunk_gla_fwd_o_gk, in the interpreter too; skipped without fla),
on batch rows with a partial last chunk and on packed documents with fla's use_graph padding rows; the refusals.

Tolerances. Against fla: the same products on the same rounded operands, summed in the interpreter as matmuls
over K-blocks that may differ from fla's (its autotuner's first tile): a rare element moves by one bf16 ulp of
itself, which passes on through the walk's later chunks; so at least 99 % of the elements are bitwise fla's and
the rest within one bf16 ulp of the largest (2^-7 of it). Against the specification (unrounded float64): the
kernel rounds the state and v_new to bf16 (2^-9 relative) where they enter each product, as fla does; the
bound fla's whole call is held to against the PyTorch KDA (tests/moontrain/model/kda/test_layer_gpu.py: RMS of
the difference <= 2^-6 of the signal's RMS) holds for each output.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported, installs the interpreter's shims, and skips this
# module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.walk import STAGE_OUTPUTS, kda_forward_walk_reference, random_walk_inputs
from moontrain.model.kda.walk_kernel import kda_forward_walk
from tests.moontrain.model.kda.test_dqkg import CU_SEQLENS

PADDING_ROWS = 3


def inputs(case: str, K: int, V: int) -> tuple[dict, dict]:
    """(the stage's inputs, the chunk lists fla's wrappers take)."""
    if case == "batch":  # T = 160: the third chunk of each row holds 32 tokens
        return random_walk_inputs(2, 160, 2, K, V, torch.bfloat16, "cpu", seed=K + V), {}
    cu_seqlens = torch.tensor(CU_SEQLENS)  # documents of 100, 30, 20 and 140 tokens
    chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * PADDING_ROWS)])
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + 63) // 64
    chunk_offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    x = random_walk_inputs(1, CU_SEQLENS[-1], 2, K, V, torch.bfloat16, "cpu", seed=K + V, cu_seqlens=cu_seqlens,
                           chunk_offsets=chunk_offsets)
    return x, dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)


def written(h: torch.Tensor, x: dict) -> torch.Tensor:
    """h's rows the sequences' chunks take (fla's padding rows stay unwritten)."""
    return h if x["cu_seqlens"] is None else h[:, : int(x["chunk_offsets"][-1])]


# (case, K, V, the kernel's value block)
CASES = [("batch", 32, 32, 16), ("batch", 64, 32, 32), ("docs", 64, 32, 16), ("docs", 128, 64, 32)]


@pytest.mark.parametrize(("case", "K", "V", "bv"), CASES)
def test_kernel_matches_the_specification(case: str, K: int, V: int, bv: int) -> None:
    x, lists = inputs(case, K, V)
    rows = lists["chunk_indices"].shape[0] if lists else None
    got = kda_forward_walk(**x, rows=rows, bv=bv)
    x64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in x.items()}
    want = kda_forward_walk_reference(**x64, rows=rows)
    for name, a, b in zip(STAGE_OUTPUTS, got, want, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        if name == "h":
            a, b = written(a, x), written(b, x)
        assert torch.isfinite(a).all(), f"{name}: not finite"
        rms = ((a.double() - b).square().mean().sqrt() / b.square().mean().sqrt()).item()
        assert rms <= 2 ** -6, f"{name}: RMS of the difference {rms:.2e} > 2^-6 of the specification's"


@pytest.mark.parametrize(("case", "K", "V", "bv"), CASES)
def test_kernel_matches_flas_two_kernels(case: str, K: int, V: int, bv: int) -> None:
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    import tests.moontrain.model.kda.fla_interpreted  # noqa: F401  (skips without fla-core)

    x, lists = inputs(case, K, V)
    got = kda_forward_walk(**x, rows=lists["chunk_indices"].shape[0] if lists else None, bv=bv)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=x["kg"], w=x["w"], u=x["u"], gk=x["g"], **lists)
    # fla's output kernel forms q 2^g itself: given qg and g = 0 it multiplies by exactly 1
    lists.pop("chunk_offsets", None)
    o = chunk_gla_fwd_o_gk(q=x["qg"], v=v_new, g=torch.zeros_like(x["g"]), A=x["Aqk"], h=h, scale=x["scale"],
                           use_graph=case == "docs", **lists)
    for name, a, b in zip(STAGE_OUTPUTS, got, (h, v_new, o), strict=True):
        if name == "h":
            a, b = written(a, x), written(b, x)
        diff = (a.float() - b.float()).abs()
        same = (diff == 0).float().mean().item()
        assert same >= 0.99, f"{name}: {same:.2%} of the elements bitwise fla's"
        top = b.float().abs().max().item()
        assert diff.max().item() <= 2 ** -7 * top, f"{name}: max |diff| {diff.max().item():.2e} > 2^-7 x {top:.2e}"


def test_refusals() -> None:
    x, _ = inputs("batch", 32, 32)
    with pytest.raises(ValueError, match="bv=24 must divide V=32"):
        kda_forward_walk(**x, bv=24)
    with pytest.raises(ValueError, match="u has shape"):
        kda_forward_walk(**{**x, "u": x["u"][:, :100]})
    with pytest.raises(ValueError, match="kg is not contiguous"):
        kda_forward_walk(**{**x, "kg": x["kg"].transpose(1, 2).contiguous().transpose(1, 2)})
    with pytest.raises(ValueError, match="g must be fp32"):
        kda_forward_walk(**{**x, "g": x["g"].bfloat16()})
    with pytest.raises(ValueError, match="powers of two"):
        kda_forward_walk(**{**x, "u": torch.zeros(*x["u"].shape[:3], 48, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="need batch 1"):
        kda_forward_walk(**{**x, "cu_seqlens": torch.tensor([0, 160])})
