"""BufferOptions.combine_reduce on one GPU (R = 1, a one-rank NCCL group of this process): the Triton
path against the PyTorch path, bitwise, for both settings, for plain rows with row scalars, route
weights folded in (row_weights), two row tensors added (add_rows) and the refresh branch (a plan that
is not the last dispatch's); at R = 1 "destination" equals "source" for plain rows (one partial per
token). The CPU tier (tests/moonep/datapath/test_combine_reduce_interpreted.py) covers R = 2 and the
documented order against a per-token loop.

    python -m pytest -q -m gpu tests/moonep/datapath/test_combine_reduce_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions
from moonep.routing import generate_routing

pytestmark = pytest.mark.gpu


def _bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    same = got.view(torch.uint8) == want.view(torch.uint8) if got.dtype != torch.bool else got == want
    if not bool(same.all()):
        bad = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{what}: first mismatch near {bad} (of {int((~same).sum())} bytes)")


def _run(buf: Buffer, x, w, topk, topk_other, seed: int) -> dict[str, torch.Tensor]:
    res = buf.dispatch(x, w, topk)
    plan, n, H = res.plan, res.plan.nvs_s, x.shape[1]
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    add = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    wt = torch.rand(n, generator=g, device="cuda")
    sc = torch.randn(n, generator=g, device="cuda")
    out = {}
    out["y"], out["scal"] = (t.clone() for t in buf.combine(plan, y, row_scalars=sc))
    out["y_w"] = buf.combine(plan, y, row_weights=wt)[0].clone()
    out["y_add"], out["scal_add"] = (t.clone() for t in buf.combine(plan, y, row_scalars=sc, add_rows=add,
                                                                     row_weights=wt))
    buf.dispatch(x, w, topk_other)
    out["y_stale"] = buf.combine(plan, y, row_scalars=sc)[0].clone()  # the refresh branch
    return out


@pytest.mark.parametrize("S,H,K,E", [(4096, 2048, 8, 64), (1000, 7168, 8, 64), (777, 1000, 4, 16)])
def test_combine_reduce_triton_bitwise_equals_torch_one_gpu(one_rank: dist.ProcessGroup, S: int, H: int, K: int,
                                                           E: int) -> None:
    outs = {}
    for reduce in ("source", "destination"):
        for kernels in ("torch", "triton"):
            cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E,
                               options=BufferOptions(kernels=kernels, combine_reduce=reduce))
            buf = Buffer(cfg, one_rank)
            try:
                routing = generate_routing(num_ranks=1, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=1.0,
                                           seed=3, device="cuda")
                other = generate_routing(num_ranks=1, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=2.0,
                                         seed=4, device="cuda")
                g = torch.Generator(device="cuda").manual_seed(1)
                x = torch.randn(S, H, generator=g, device="cuda").to(torch.bfloat16)
                w = torch.rand(S, K, generator=g, device="cuda")
                outs[reduce, kernels] = _run(buf, x, w, routing.topk_RsK[0], other.topk_RsK[0], seed=2)
                torch.cuda.synchronize()
            finally:
                buf.destroy()
    for reduce in ("source", "destination"):
        want, got = outs[reduce, "torch"], outs[reduce, "triton"]
        for name in want:
            _bitwise(got[name], want[name], f"S={S} H={H} K={K} E={E} {reduce}: {name}")
    for kernels in ("torch", "triton"):  # R = 1: one partial per token, the source's order
        for name in ("y", "scal", "y_stale"):
            _bitwise(outs["destination", kernels][name], outs["source", kernels][name], f"R=1 {kernels}: {name}")
