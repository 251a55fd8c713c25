"""moontrain.model.kda.intra_fwd_kernel on one GPU at k3_small's heads (16 of 128) against fla-core's
chunk_kda_fwd_intra (three kernels and a fill) and the float64 specification (moontrain.model.kda.intra_fwd), on
batch rows with a partial last chunk and on packed documents with fla's use_graph padding rows, at the kernel's
default tile and another. The call through the kernel against fla's chunk_kda is
tests/moontrain/model/kda/test_chunk_gpu.py's.

Tolerances: against the specification, test_intra_fwd_kernel_interpreted.py's (2^-7 of the signal's RMS: bf16
outputs from at most four bf16 roundings). Against fla: on the tensor cores both sum their tf32 products in the
hardware's order and differ in the exponentials' anchors, so elements land on adjacent bf16 values more often
than in the interpreter: the RMS of the difference is at most 2^-8 of fla's RMS (about one bf16 rounding), and
the largest difference at most 2^-6 of fla's largest value.
"""

from __future__ import annotations

import pytest
import torch

from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.intra_fwd import (
    STAGE_OUTPUTS,
    kda_intra_forward_reference,
    on_or_below_diagonal,
    random_intra_forward_inputs,
)
from moontrain.model.kda.intra_fwd_kernel import kda_intra_forward
from moontrain.model.kda.layer import fla_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fla_available(), reason="needs fla-core (bash ../shared/device/stage.sh fla)")]


def _inputs(documents: bool) -> dict:
    if not documents:
        return random_intra_forward_inputs(2, 1000, 16, 128, 128, torch.bfloat16, "cuda", seed=1)
    cu_seqlens = torch.tensor([0, 1, 64, 65, 300, 999, 1513, 2000], device="cuda")
    chunk_indices = torch.cat([prepare_chunk_indices(cu_seqlens), torch.tensor([[-1, 0]] * 5, device="cuda")])
    return random_intra_forward_inputs(1, 2000, 16, 128, 128, torch.bfloat16, "cuda", seed=2, cu_seqlens=cu_seqlens,
                                       chunk_indices=chunk_indices)


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("tile", [None, (32, 32, 4, 1)], ids=lambda t: "default" if t is None else
                         "bk{}-bv{}-w{}-s{}".format(*t))
def test_intra_forward_matches_fla_and_the_spec(documents: bool, tile: tuple[int, int, int, int] | None) -> None:
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

    x = _inputs(documents)
    launch = {} if tile is None else dict(zip(("bk", "bv", "warps", "stages"), tile, strict=True))
    got = kda_intra_forward(**x, **launch)
    ref = chunk_kda_fwd_intra(q=x["q"], k=x["k"], v=x["v"], gk=x["g"], beta=x["beta"], scale=x["scale"],
                              cu_seqlens=x["cu_seqlens"], chunk_indices=x["chunk_indices"], safe_gate=True,
                              disable_recompute=True, use_graph=documents)
    x64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in x.items()}
    spec = kda_intra_forward_reference(**x64)
    for name, a, b, c in zip(STAGE_OUTPUTS, got, ref, spec, strict=True):
        if name == "Aqk":  # fla leaves the blocks above the diagonal unwritten
            keep = on_or_below_diagonal(a, x["cu_seqlens"])
            a, b = a.masked_fill(~keep, 0), b.masked_fill(~keep, 0)
        assert torch.isfinite(a).all(), f"{name}: not finite"
        rms = ((a.double() - c).square().mean().sqrt() / c.square().mean().sqrt()).item()
        assert rms <= 2 ** -7, f"{name}: RMS of the difference from the spec {rms:.2e} > 2^-7 of its RMS"
        d = a.float() - b.float()
        rms_fla = (d.square().mean().sqrt() / b.float().square().mean().sqrt()).item()
        assert rms_fla <= 2 ** -8, f"{name}: RMS of the difference from fla {rms_fla:.2e} > 2^-8 of fla's RMS"
        top = b.float().abs().max().item()
        err = d.abs().max().item()
        assert err <= 2 ** -6 * top, f"{name}: max |diff| {err:.2e} > 2^-6 x {top:.2e}"
