"""moontrain.model.kda.walk_kernel on one GPU at k3_small's heads (16 of 128) against fla-core's two kernels it
replaces (chunk_gated_delta_rule_fwd_h, chunk_gla_fwd_o_gk) and the float64 specification (moontrain.model.kda.walk),
on batch rows with a partial last chunk and on packed documents with fla's use_graph padding rows, at the kernel's
default tile and at the others benchmarks/bench_kda_walk.py times. The call through the kernel against fla's
chunk_kda is tests/moontrain/model/kda/test_chunk_gpu.py's.

Tolerances: test_walk_kernel_interpreted.py's, with one more reason for a differing element: the tensor cores
sum a product's K-steps in their own order, which may differ from fla's split of K into blocks.
"""

from __future__ import annotations

import pytest
import torch

from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.layer import fla_available
from moontrain.model.kda.walk import STAGE_OUTPUTS, kda_forward_walk_reference, random_walk_inputs
from moontrain.model.kda.walk_kernel import kda_forward_walk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fla_available(), reason="needs fla-core (bash ../shared/device/stage.sh fla)")]


def _inputs(documents: bool) -> tuple[dict, dict]:
    if not documents:
        return random_walk_inputs(2, 1000, 16, 128, 128, torch.bfloat16, "cuda", seed=1), {}
    cu_seqlens = torch.tensor([0, 1, 64, 65, 300, 999, 1513, 2000], device="cuda")
    chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * 5, device="cuda")])
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + 63) // 64
    chunk_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x = random_walk_inputs(1, 2000, 16, 128, 128, torch.bfloat16, "cuda", seed=2, cu_seqlens=cu_seqlens,
                           chunk_offsets=chunk_offsets)
    return x, dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("tile", [(32, 4, 1), (32, 4, 2), (64, 8, 1), (16, 4, 3)],
                         ids=lambda t: "bv{}-w{}-s{}".format(*t))
def test_walk_matches_fla_and_the_spec(documents: bool, tile: tuple[int, int, int]) -> None:
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    x, lists = _inputs(documents)
    rows = lists["chunk_indices"].shape[0] if lists else None
    bv, warps, stages = tile
    got = kda_forward_walk(**x, rows=rows, bv=bv, warps=warps, stages=stages)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=x["kg"], w=x["w"], u=x["u"], gk=x["g"], **lists)
    lists.pop("chunk_offsets", None)
    o = chunk_gla_fwd_o_gk(q=x["qg"], v=v_new, g=torch.zeros_like(x["g"]), A=x["Aqk"], h=h, scale=x["scale"],
                           use_graph=documents, **lists)
    x64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in x.items()}
    spec = kda_forward_walk_reference(**x64, rows=rows)
    n_h = h.shape[1] if not documents else int(x["chunk_offsets"][-1])
    for name, a, b, c in zip(STAGE_OUTPUTS, got, (h, v_new, o), spec, strict=True):
        if name == "h":
            a, b, c = a[:, :n_h], b[:, :n_h], c[:, :n_h]
        diff = (a.float() - b.float()).abs()
        same = (diff == 0).float().mean().item()
        assert same >= 0.99, f"{name}: {same:.2%} of the elements bitwise fla's"
        top = b.float().abs().max().item()
        assert diff.max().item() <= 2 ** -7 * top, f"{name}: max |diff| {diff.max().item():.2e} > 2^-7 x {top:.2e}"
        rms = ((a.double() - c).square().mean().sqrt() / c.square().mean().sqrt()).item()
        assert rms <= 2 ** -6, f"{name}: RMS from the specification {rms:.2e} > 2^-6"
