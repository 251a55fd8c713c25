"""moontrain.model.kda.dqkg_kernel on one GPU at a KDA layer's shape (B=2, T=4096, H=16, K=V=128, bf16):
against fla-core's chunk_kda_bwd_wy_dqkg_fused (the kernel it replaces) and the fp32 specification
kda_dqkg_reference, without and with packed documents (fla's host-listed and device-listed, use_graph,
chunk lists); and with fp32 inputs against the specification.

Tolerances, relative to each output's largest magnitude (the interpreted test's derivation, at this shape):
- bf16 against the specification: dq 1e-4 (fp32 sums of exact products over 128 terms); dv2 2^-7 + 1e-4
  (one bf16 rounding); dk, dg, db, dA 2.3e-2 (up to three bf16 roundings of fp32 operands, 2^-9 each, as
  fla does, times 4 for the absolute sums). And no worse than fla's own error against the specification,
  up to a factor 1.5 plus 1e-4 (the two round at the same points and sum in different orders).
- bf16 against fla: the sum of both kernels' bounds (each is within its bound of the specification).
- fp32 inputs: Triton's tl.dot rounds fp32 operands to tf32 (2^-11): up to four roundings along a path, times
  4: 4 * 4 * 2^-11 = 7.8e-3.
"""

from __future__ import annotations

import pytest
import torch

from moontrain.model.kda.dqkg import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda.dqkg import kda_dqkg_reference
from moontrain.model.kda.dqkg import random_stage_inputs as stage_inputs

# the kernel module and fla import triton: only inside the tests, which run on a GPU machine only. Imported
# at collection they would import triton on the CPU tier before an *_interpreted module of the same session
# sets TRITON_INTERPRET (e.g. `pytest tests/moontrain/model/test_kda_dqkg_kernel*.py`)
pytestmark = pytest.mark.gpu

B, T, H, K, V = 2, 4096, 16, 128, 128
BF16_TOL = {"dq": 1e-4, "dv2": 2 ** -7 + 1e-4, "dk": 2.3e-2, "dg": 2.3e-2, "db": 2.3e-2, "dA": 2.3e-2}
TF32_TOL = 4 * 4 * 2 ** -11


def packed_documents(num_graph_pad: int) -> dict:
    """The two rows flattened to one, a sequence starting at each row start and ~every 700 tokens at random
    (plus a 1-token and a 65-token document): cu_seqlens (int32, as the trainer passes it) and fla's chunk
    list; with num_graph_pad > 0, fla's use_graph list (prepare_chunk_indices_static) with that many padding
    rows and two zero-length padding sequences."""
    from fla.ops.utils import prepare_chunk_indices
    from fla.ops.utils.index import prepare_chunk_indices_static

    gen = torch.Generator().manual_seed(3)
    starts = set((torch.nonzero(torch.rand(B * T, generator=gen) < 1 / 700).flatten()).tolist())
    starts |= {0, T, 1000, 1001, 3000, 3065}
    cu = torch.tensor([*sorted(starts), B * T], dtype=torch.int32, device="cuda")
    if num_graph_pad == 0:
        return dict(cu_seqlens=cu, chunk_indices=prepare_chunk_indices(cu, 64))
    cu = torch.cat([cu, cu[-1:].repeat(2)])
    num_chunks = int(((cu[1:] - cu[:-1] + 63) // 64).sum())
    chunk_indices, chunk_offsets = prepare_chunk_indices_static(cu, 64, num_chunks + num_graph_pad)
    return dict(cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, use_graph=True)


def inputs_for(case: str, dtype: torch.dtype, seed: int) -> dict:
    if case == "batch":
        return stage_inputs(B, T, H, K, V, dtype, "cuda", seed)
    docs = packed_documents(num_graph_pad=5 if case == "docs_graph" else 0)
    inputs = stage_inputs(1, B * T, H, K, V, dtype, "cuda", seed, cu_seqlens=docs["cu_seqlens"],
                          chunk_indices=docs["chunk_indices"])
    return {**inputs, **docs}


def max_rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()


@pytest.mark.parametrize("case", ["batch", "docs", "docs_graph"])
def test_bf16_matches_fla_and_reference(case: str) -> None:
    fla_bwd = pytest.importorskip("fla.ops.kda.chunk_bwd", reason="needs fla-core (pip install fla-core==0.6.0)")
    from moontrain.model.kda.dqkg_kernel import kda_dqkg

    inputs = inputs_for(case, torch.bfloat16, seed=0)
    ours = kda_dqkg(**inputs)
    fla = [x.clone() for x in fla_bwd.chunk_kda_bwd_wy_dqkg_fused(**inputs)]  # use_graph: static buffers
    ref = kda_dqkg_reference(**inputs)
    for name, x, y, r in zip(OUTPUTS, ours, fla, ref, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {x.shape} vs fla {y.dtype} {y.shape}"
        tol = BF16_TOL[name]
        ours_err, fla_err = max_rel(x, r), max_rel(y, r)
        assert ours_err <= tol, f"{name}: {ours_err:.2e} of max |ref| from the specification > {tol:.1e}"
        assert ours_err <= 1.5 * fla_err + 1e-4, f"{name}: ours {ours_err:.2e} vs fla {fla_err:.2e} from the spec"
        assert max_rel(x, y) <= 2 * tol, f"{name}: {max_rel(x, y):.2e} of max |fla| from fla > {2 * tol:.1e}"


@pytest.mark.parametrize("case", ["batch", "docs"])
def test_fp32_matches_reference(case: str) -> None:
    pytest.importorskip("fla", reason="needs fla-core (pip install fla-core==0.6.0): its chunk lists")
    from moontrain.model.kda.dqkg_kernel import kda_dqkg

    inputs = inputs_for(case, torch.float32, seed=1)
    for name, x, r in zip(OUTPUTS, kda_dqkg(**inputs), kda_dqkg_reference(**inputs), strict=True):
        assert x.dtype == r.dtype and x.shape == r.shape, name
        assert max_rel(x, r) <= TF32_TOL, f"{name}: {max_rel(x, r):.2e} of max |ref| > {TF32_TOL:.1e}"


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
@pytest.mark.parametrize("docs", [False, True])
def test_kda_layer_call_with_the_stage_routed_here_matches_fla(docs: bool, recompute: bool) -> None:
    """kernels.kda_dqkg=moontrain end to end: kda_fla's forward + backward (B=2, T=4096, 16 heads of 128, bf16;
    documents every 1024 tokens on fla's device-listed chunks) with fla's stage routed to kda_dqkg, against the
    same call on fla's kernel: the output bitwise (the stage is backward only), every input grad within 5e-2 of
    its largest value (twice the stage's own bound against the specification, 2.3e-2, for the two paths; fla's
    later kernels and the L2 norm's backward are shared), and the routed call reached kda_dqkg. recompute:
    kernels.kda_recompute (False, the model's default: the backward reads the forward's saved states)."""
    pytest.importorskip("fla", reason="needs fla-core (pip install fla-core==0.6.0)")
    from moontrain.model.kda import dqkg_kernel as kda_dqkg_kernel
    from moontrain.model.kda.fla_backend import route_fla_stages
    from moontrain.model.kda.ops import kda_fla, random_kda_inputs

    leaves, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=1024 if docs else None, seed=3)

    def run() -> list[torch.Tensor]:
        o = kda_fla(*leaves, **kwargs, recompute=recompute)
        return [o.detach().clone(), *(g.clone() for g in torch.autograd.grad(o, leaves, go))]

    calls = []
    own = kda_dqkg_kernel.kda_dqkg
    try:
        kda_dqkg_kernel.kda_dqkg = lambda **kw: calls.append(1) or own(**kw)
        route_fla_stages(dqkg="moontrain", intra="fla")
        routed = run()
    finally:
        route_fla_stages(dqkg="fla", intra="fla")
        kda_dqkg_kernel.kda_dqkg = own
    base = run()
    assert len(calls) == 1
    assert torch.equal(routed[0], base[0])
    for name, x, y in zip(("dq", "dk", "dv", "df", "dbeta"), routed[1:], base[1:], strict=True):
        assert max_rel(x, y) <= 5e-2, f"{name}: {max_rel(x, y):.2e} of max |fla path| > 5e-2"
