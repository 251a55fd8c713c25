"""moontrain.model.kda.intra_kernel on one GPU at a KDA layer's shape (B=2, T=4096, H=16, K=128, bf16 q/k, fp32
gradients): against fla-core's chunk_kda_bwd_intra (the kernel it replaces) and the fp32 specification
kda_intra_reference, without and with packed documents (fla's host-listed and device-listed, use_graph, chunk
lists), with gates at their bound; and KDA's whole backward with the stage routed here.

Tolerances, relative to each output's largest magnitude. The kernel's products round fp32 operands to TF32
(2^-11, both operands: 2^-10 a term), as fla's off-diagonal products do; over sums of <= 64 terms of either
sign, allowing the terms' absolute sum 4x the largest output: 4 * 2^-10 = 3.9e-3. And no worse than fla's
own error against the specification, up to a factor 4 plus 1e-4 (fla's diagonal blocks use bf16x3, ~fp32, so
its error can be the smaller). Against fla: the sum of both bounds.
"""

from __future__ import annotations

import pytest
import torch

from moontrain.model.kda.intra import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda.intra import kda_intra_reference, random_stage_inputs
from tests.moontrain.model.kda.test_dqkg_kernel_gpu import max_rel, packed_documents

# the kernel module and fla import triton: only inside the tests (test_kda_dqkg_kernel_gpu's note)
pytestmark = pytest.mark.gpu

B, T, H, K = 2, 4096, 16, 128
TOL = 4 * 2 ** -10


def inputs_for(case: str, seed: int, at_bound: bool = False) -> dict:
    if case == "batch":
        inputs = random_stage_inputs(B, T, H, K, torch.bfloat16, "cuda", seed, at_bound=at_bound)
    else:
        docs = packed_documents(num_graph_pad=5 if case == "docs_graph" else 0)
        inputs = random_stage_inputs(1, B * T, H, K, torch.bfloat16, "cuda", seed, cu_seqlens=docs["cu_seqlens"],
                                     chunk_indices=docs["chunk_indices"], at_bound=at_bound)
        inputs["use_graph"] = docs.get("use_graph", False)
    # fla's kernel reads dAkk's diagonal (the dqkg stage writes zeros there) and masks the rest it must not read
    inputs["dAqk"], inputs["dAkk"] = inputs["dAqk"].nan_to_num(0.0), inputs["dAkk"].nan_to_num(0.0)
    return inputs


# gates at their bound: the diagonal blocks dominate the sums, fla computes them in bf16x3 (~fp32) and lands
# 2.6e-6 from the specification, this kernel's TF32 products 2.3e-4 (inside TOL, not inside 4x fla's error):
# a known gap of the opt-in kernel (docs/performance.md, 2026-12-03); strict, so closing it shows here
AT_BOUND_GAP = pytest.mark.xfail(strict=True, reason="TF32 diagonal blocks vs fla's bf16x3 at the gate bound")


@pytest.mark.parametrize(("case", "at_bound"), [("batch", False), ("docs", False), ("docs_graph", False),
                                                pytest.param("batch", True, marks=AT_BOUND_GAP)])
def test_matches_fla_and_reference(case: str, at_bound: bool) -> None:
    fla_intra = pytest.importorskip("fla.ops.kda.chunk_intra", reason="needs fla-core (pip install fla-core==0.6.0)")
    from moontrain.model.kda.intra_kernel import kda_intra

    inputs = inputs_for(case, seed=0, at_bound=at_bound)
    ours = kda_intra(**inputs)
    fla = [x.clone() for x in fla_intra.chunk_kda_bwd_intra(**inputs)]  # use_graph: static buffers
    ref = kda_intra_reference(**inputs)
    for name, x, y, r in zip(OUTPUTS, ours, fla, ref, strict=True):
        assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape, f"{name}: {x.dtype} {x.shape} vs fla"
        ours_err, fla_err = max_rel(x, r), max_rel(y, r)
        print(f"{case} at_bound={at_bound} {name}: ours {ours_err:.2e}, fla {fla_err:.2e} of max |ref|")
        assert ours_err <= TOL, f"{name}: {ours_err:.2e} of max |ref| from the specification > {TOL:.1e}"
        assert ours_err <= 4 * fla_err + 1e-4, f"{name}: ours {ours_err:.2e} vs fla {fla_err:.2e} from the spec"
        assert max_rel(x, y) <= 2 * TOL, f"{name}: {max_rel(x, y):.2e} of max |fla| from fla > {2 * TOL:.1e}"


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
@pytest.mark.parametrize("docs", [False, True])
def test_kda_layer_call_with_the_stage_routed_here_matches_fla(docs: bool, recompute: bool) -> None:
    """kernels.kda_intra=moontrain end to end: kda_fla's forward + backward (B=2, T=4096, 16 heads of 128, bf16,
    gate bound -5; documents every 1024 tokens on fla's device-listed chunks), both stages routed here against
    only the dqkg stage: the output bitwise (backward only), every input grad within 1e-2 of its largest value
    (2.5x the stage's bound against the specification; fla's later kernels are shared), and the routed call
    reached kda_intra. recompute: kernels.kda_recompute (False, the model's default: the backward reads the
    forward's saved states)."""
    pytest.importorskip("fla", reason="needs fla-core (pip install fla-core==0.6.0)")
    from moontrain.model.kda import intra_kernel as kda_intra_kernel
    from moontrain.model.kda.fla_backend import route_fla_stages
    from moontrain.model.kda.ops import kda_fla, random_kda_inputs

    leaves, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=1024 if docs else None, seed=3)

    def run(intra: str) -> list[torch.Tensor]:
        route_fla_stages(dqkg="moontrain", intra=intra)
        try:
            o = kda_fla(*leaves, **kwargs, recompute=recompute)
            return [o.detach().clone(), *(g.clone() for g in torch.autograd.grad(o, leaves, go))]
        finally:
            route_fla_stages(dqkg="fla", intra="fla")

    calls = []
    own = kda_intra_kernel.kda_intra
    try:
        kda_intra_kernel.kda_intra = lambda **kw: calls.append(1) or own(**kw)
        routed = run(intra="moontrain")
    finally:
        kda_intra_kernel.kda_intra = own
    base = run(intra="fla")
    assert len(calls) == 1
    assert torch.equal(routed[0], base[0])
    for name, x, y in zip(("dq", "dk", "dv", "df", "dbeta"), routed[1:], base[1:], strict=True):
        print(f"docs={docs} {name}: {max_rel(x, y):.2e} of max |fla path|")
        assert max_rel(x, y) <= 1e-2, f"{name}: {max_rel(x, y):.2e} of max |fla path| > 1e-2"
