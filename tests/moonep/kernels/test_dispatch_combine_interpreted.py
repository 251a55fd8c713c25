"""The data path's kernels (moonep.kernels.dispatch_combine) in Triton's interpreter on the CPU against the
PyTorch path at R = 2: dispatch rows and weights, saved-plan dispatch, combine's scalar gather and a combine
with a plan that is not the last dispatched one, bitwise. Combine's output is within one bf16 ulp: the
interpreter truncates fp32 -> bf16 where the GPU rounds (on the GPU
tests/moonep/kernels/test_dispatch_combine_multigpu.py checks it bitwise).
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and installs the interpreter's shims
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moonep import BufferOptions
from tests.dist_utils import run_ranks

BF16_ULP = 2.0**-7  # relative spacing of bf16


def _dispatch_kernels_rank(rank: int, world: int, scatter_tile: int) -> tuple[list[int], list[tuple[int, int]]]:
    import moonep.buffer as buffer_module
    from moonep import Buffer, BufferConfig
    from moonep.routing import generate_routing

    S, H, K, E = 40, 80, 4, 8 * world
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4,
                       options=BufferOptions(num_sms=3, scatter_tile=scatter_tile))
    ref = Buffer(cfg)
    # the triton path is CUDA-only by design; force it onto the CPU heap for the interpreter
    buffer_module.resolve_kernels = lambda kernels, device: "triton"
    fast = Buffer(cfg)
    try:
        assert fast.kernel_path == "triton" and ref.kernel_path == "torch"
        g = torch.Generator().manual_seed(100 + rank)
        used, dups = [], []
        for maxvio, s in ((0.0, S), (1.0, 37), (2.9, S)):
            routing = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K,
                                       target_maxvio=maxvio, seed=5)
            topk, hist = routing.for_rank(rank)
            x = torch.randn(s, H, generator=g).to(torch.bfloat16)
            w = torch.rand(s, K, generator=g)
            grad = torch.randn(s, H, generator=g).to(torch.bfloat16)
            topk2, hist2 = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K,
                                            target_maxvio=1.5, seed=6).for_rank(rank)
            outs = []
            for buf in (ref, fast):
                res = buf.dispatch(x, w, topk, hist)
                out = {"rows": res.x_rows.clone(), "weights": res.weights_rows.clone()}
                out["saved_rows"] = buf.dispatch(grad, plan=res.plan).x_rows.clone()
                y_rows = torch.randn(res.plan.nvs_s, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
                scal = torch.randn(res.plan.nvs_s, generator=torch.Generator().manual_seed(8))
                out["y"], out["scalars"] = buf.combine(res.plan, y_rows, row_scalars=scal)
                # combine with a plan that is not the last dispatched one: the row_src refresh path
                # (scatter with rows=False, expand without copies)
                out["rows_other"] = buf.dispatch(x, w, topk2, hist2).x_rows.clone()
                out["y_stale_plan"] = buf.combine(res.plan, y_rows)[0]
                outs.append(out)
                used.append(int((res.plan.slot_expert_RB >= 0).sum()))
            # duplicates on this rank (stored by its scatter) and on the peer (copied by the peer's expand)
            p = res.plan
            dup = p.copy_row_sK != p.dst_row_sK
            dups.append((int((dup & (p.dst_rank_sK == rank)).sum()), int((dup & (p.dst_rank_sK != rank)).sum())))
            want, got = outs
            for key in ("rows", "weights", "saved_rows", "scalars", "rows_other"):
                assert torch.equal(got[key], want[key]), f"{key} differs at maxvio {maxvio}"
            # the interpreter casts fp32 -> bf16 by truncation, the GPU (and torch) by rounding
            for key in ("y", "y_stale_plan"):
                err = (got[key].float() - want[key].float()).abs()
                assert bool((err <= BF16_ULP * want[key].float().abs()).all()), f"{key} off by > 1 ulp ({err.max()})"
            # the scatter's block counter and exit counter are back to zero after every launch
            assert fast.path._scatter_work.tolist() == [0, 0], fast.path._scatter_work
        return used, dups
    finally:
        fast.destroy()
        ref.destroy()


@pytest.mark.parametrize("scatter_tile", [16384, 256])
def test_dispatch_combine_kernels_match_pytorch_path(scatter_tile: int) -> None:
    """The default tile; a 256-element tile (2 tokens per block) makes each program loop."""
    (used, dups0), (_, dups1) = run_ranks(_dispatch_kernels_rank, 2, scatter_tile, timeout_s=300)
    assert any(n > 0 for n in used), f"some routing should occupy slots: {used}"
    dups = dups0 + dups1  # (on the own rank, on the peer) per rank and case
    assert all(own > 0 and peer > 0 for own, peer in dups), f"need duplicates on the own rank and the peer: {dups}"
