"""moontrain.model.kda.short_conv_kernel on one GPU at a KDA layer's shape ([4, 4096, 2048] bf16, x a column
slice of a wider projection output): y, dx and dw against the float64 specification within the derived
bound of tests/moontrain/model/kda/short_conv_cases.py, and torch.compile(fullgraph=True) through the custom
op giving the eager kernel's bits; both backward routes (kernels.short_conv_backward)."""

from __future__ import annotations

import pytest
import torch

from moontrain.model.kda import short_conv_kernel
from moontrain.model.kda.short_conv_kernel import short_conv_silu
from tests.moontrain.model.kda.short_conv_cases import check_short_conv, conv_inputs, doc_ids

pytestmark = pytest.mark.gpu

B, T, C, W = 4, 4096, 2048, 4


@pytest.mark.parametrize("backward", ["tiles", "walk"])
@pytest.mark.parametrize("docs", [True, False])
def test_short_conv_kda_shape(docs: bool, backward: str) -> None:
    x, w, dy = conv_inputs(B, T, C, W, torch.bfloat16, torch.float32, "cuda", seed=0)
    doc_id = None
    if docs:  # ~6 documents per row at random, plus lengths 1 (t = 0 and t = 130) and a start at t = 1
        gen = torch.Generator(device="cuda").manual_seed(1)
        doc_id = doc_ids(B, T, [[1, 130, 131]] * B, "cuda", gen, p_start=1 / 700)
    check_short_conv(x, w, doc_id, dy, backward)


@pytest.mark.parametrize("backward", ["tiles", "walk"])
def test_torch_compile_fullgraph_matches_eager_bitwise(backward: str) -> None:
    """matmul -> column slice -> short_conv_silu -> matmul compiled with fullgraph=True (a graph break
    raises): the output and dx are the eager kernels' bits (Inductor launches the same Triton kernels);
    dw differs at most by the order of the fp32 sum over the partials, and is checked to an fp32 bound."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    D = 256
    h = torch.randn(2, 1024, D, generator=gen, device="cuda").to(torch.bfloat16)
    a = (torch.randn(D, 3 * C, generator=gen, device="cuda") / D ** 0.5).to(torch.bfloat16)
    b = (torch.randn(C, D, generator=gen, device="cuda") / C ** 0.5).to(torch.bfloat16)
    w = torch.rand(C, 1, W, generator=gen, device="cuda") - 0.5
    doc_id = doc_ids(2, 1024, [[1, 300, 301]] * 2, "cuda")

    def f(h, a, w, doc_id):
        qkv = h @ a
        return short_conv_silu(qkv[..., C:2 * C], w, doc_id, backward=backward) @ b

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        ag, wg = a.detach().requires_grad_(), w.detach().requires_grad_()
        y = fn(h, ag, wg, doc_id)
        outs.append((y, *torch.autograd.grad(y, (ag, wg), torch.ones_like(y))))
    (y, da, dw), (y_c, da_c, dw_c) = outs
    for name, got, want in (("y", y_c, y), ("da", da_c, da)):
        assert torch.equal(got, want), f"{name}: first mismatch at {(got != want).nonzero()[0].tolist()}"
    # dw: the same fp32 partials (one per batch row and 64-row time block or span) summed in Inductor's order:
    # |dw_c - dw| <= 2 (NB - 1) eps32 sum |partials|, and sum |partials| <= max|silu'| sum_t |dy_t| |x_t-s|
    # <= 1.1 B T max|dy| max|x|, dy = 1 @ b^T the gradient reaching the conv
    num_partials = 2 * 1024 // (short_conv_kernel.BWD_BLOCK_T if backward == "tiles" else short_conv_kernel.WALK_SPAN)
    dy = torch.ones(1, D, device="cuda", dtype=torch.bfloat16) @ b.T
    x = (h @ a)[..., C:2 * C]
    sum_abs = 1.1 * 2 * 1024 * dy.abs().max().item() * x.abs().max().item()
    bound = 2 * (num_partials - 1) * torch.finfo(torch.float32).eps * sum_abs
    assert (dw_c - dw).abs().max().item() <= bound, f"dw: {(dw_c - dw).abs().max().item():.3g} > {bound:.3g}"
