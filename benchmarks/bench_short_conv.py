"""KDA's short convolution + SiLU on one GPU: the Triton kernels (moontrain.model.kda.short_conv_kernel) against
the PyTorch specification compiled by inductor (what train.compile ran before the kernel), forward and
backward, a sweep of the forward's tiles and of the backward's dpre tiles, and the walking backward
(kernels.short_conv_backward=walk, dx and dw in one kernel) over its spans and channel blocks.

    python benchmarks/bench_short_conv.py [--iters 20] [--warmup 3] [--out bench_short_conv.json]

Shape: one KDA projection of k3_small at 4 x 4096 tokens, [4, 4096, 2048] bf16, x a column slice of the
[4, 4096, 10256] output of the layer's stacked input GEMM (as the layer calls it), W = 4, with and
without packed documents (~6 per row). Rows: the specification compiled, forward and forward + backward;
the kernel's forward, dpre (+ the weight grad's partials and their sum) and dx; then dpre per tile
(BWD_BLOCK_T x BWD_BLOCK_C, warps), each checked against the default
tiles (dpre bitwise; dw to the fp32 summation order); then the walk per (WALK_SPAN, WALK_BLOCK_C, warps) against
the default tiles' dpre + dx (its dx from fp32 dpre, theirs from dpre rounded to bf16: within a bf16 ulp). Median
ms of CUDA-event timings, the device's time alone (it spins before each timed call while the host launches: the
kernels take 50-200 us, about what their launches cost the host). GPU only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import moontrain.model.kda.short_conv_kernel as kernel
from benchmarks.timing import ONE_CALL_AHEAD_MS, kernel_bench_args, median_ms
from moontrain.model.kda.short_conv import short_conv

B, T, C, W, WIDE = 4, 4096, 2048, 4, 10256
FWD_TILES = [(32, 128, 4), (16, 128, 4), (64, 128, 4), (32, 256, 4), (16, 256, 4), (64, 64, 4), (32, 128, 2),
             (8, 256, 4), (16, 512, 4), (32, 256, 8)]
# FWD_BLOCK_T, FWD_BLOCK_C, warps (the forward's)
TILES = [(64, 64, 4), (32, 64, 4), (32, 128, 4), (16, 128, 4), (16, 256, 8), (128, 32, 4), (64, 128, 8)]
# BWD_BLOCK_T, BWD_BLOCK_C, warps
WALKS = [(64, 512, 4), (128, 512, 4), (32, 512, 4), (64, 256, 2), (64, 1024, 8), (64, 256, 4), (256, 512, 4),
         (16, 512, 4), (32, 256, 2), (16, 256, 2), (32, 256, 4)]
# WALK_SPAN, WALK_BLOCK_C, warps


def inputs(docs: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, WIDE, device="cuda", generator=gen).to(torch.bfloat16)[..., :C]
    w = (torch.rand(C, 1, W, device="cuda", generator=gen) - 0.5).to(torch.bfloat16)
    dy = torch.randn(B, T, C, device="cuda", generator=gen).to(torch.bfloat16)
    doc_id = None
    if docs:
        start = torch.rand(B, T, device="cuda", generator=gen) < 1 / 700
        start[:, 0] = False
        doc_id = start.long().cumsum(1)
    return x, w, dy, doc_id


def bench_case(docs: bool, time_ms: Callable[[Callable[[], object]], float]) -> list[dict]:
    """The rows of one case (with or without documents); prints them."""
    x, w, dy, doc_id = inputs(docs)
    xg = x.detach().requires_grad_()
    spec = torch.compile(short_conv, dynamic=False)
    spec_fwd = time_ms(lambda: spec(x, w, doc_id))
    spec_both = time_ms(lambda: spec(xg, w, doc_id).backward(dy))
    fwd = time_ms(lambda: kernel.short_conv_silu(x, w, doc_id))
    ref = torch.ops.moontrain.short_conv_silu_dpre(dy, x, w, doc_id)
    dx = time_ms(lambda: torch.ops.moontrain.short_conv_silu_dx(ref[0], w, doc_id))
    rows = [dict(docs=docs, spec_fwd_ms=spec_fwd, spec_fwd_bwd_ms=spec_both, fwd_ms=fwd, dx_ms=dx)]
    print(f"docs {docs!s:5}: specification compiled fwd {spec_fwd * 1e3:6.1f} us, fwd + bwd {spec_both * 1e3:6.1f}"
          f" us; kernel fwd {fwd * 1e3:6.1f} us, dx {dx * 1e3:6.1f} us")
    default = (kernel.BWD_BLOCK_T, kernel.BWD_BLOCK_C, kernel.NUM_WARPS)
    default_fwd = (kernel.FWD_BLOCK_T, kernel.FWD_BLOCK_C, kernel.NUM_WARPS)
    ref_y = kernel.short_conv_silu(x, w, doc_id)
    for tile in FWD_TILES:
        kernel.FWD_BLOCK_T, kernel.FWD_BLOCK_C, kernel.NUM_WARPS = tile
        same = torch.equal(kernel.short_conv_silu(x, w, doc_id), ref_y)
        ms = time_ms(lambda: kernel.short_conv_silu(x, w, doc_id))
        rows.append(dict(docs=docs, fwd_tile=list(tile), fwd_ms=ms, y_bitwise=same))
        print(f"  fwd {tile[0]:3d} x {tile[1]:3d}, {tile[2]} warps: {ms * 1e3:7.1f} us (y bitwise {same})")
    kernel.FWD_BLOCK_T, kernel.FWD_BLOCK_C, kernel.NUM_WARPS = default_fwd
    for tile in TILES:
        kernel.BWD_BLOCK_T, kernel.BWD_BLOCK_C, kernel.NUM_WARPS = tile
        out = torch.ops.moontrain.short_conv_silu_dpre(dy, x, w, doc_id)
        ms = time_ms(lambda: torch.ops.moontrain.short_conv_silu_dpre(dy, x, w, doc_id))
        same = torch.equal(out[0], ref[0])
        dw_diff = (out[1].float() - ref[1].float()).abs().max().item()
        rows.append(dict(docs=docs, tile=list(tile), dpre_ms=ms, dpre_bitwise=same, dw_max_diff=dw_diff))
        print(f"  dpre {tile[0]:3d} x {tile[1]:3d}, {tile[2]} warps: "
              f"{ms * 1e3:7.1f} us (dpre bitwise {same}, dw max diff {dw_diff:.2e})")
    kernel.BWD_BLOCK_T, kernel.BWD_BLOCK_C, kernel.NUM_WARPS = default
    # the walking backward (kernels.short_conv_backward=walk): dx and dw in one kernel, against dpre + dx's sum
    tiles_ms = min(r["dpre_ms"] for r in rows[1:] if r.get("tile") == list(default)) + dx
    ref_dx = torch.ops.moontrain.short_conv_silu_dx(ref[0], w, doc_id)
    default_walk = (kernel.WALK_SPAN, kernel.WALK_BLOCK_C, kernel.WALK_WARPS)
    for walk in WALKS:
        kernel.WALK_SPAN, kernel.WALK_BLOCK_C, kernel.WALK_WARPS = walk
        out = torch.ops.moontrain.short_conv_silu_bwd_walk(dy, x, w, doc_id)
        ms = time_ms(lambda: torch.ops.moontrain.short_conv_silu_bwd_walk(dy, x, w, doc_id))
        scale = ref_dx.float().abs().max().item()
        dx_diff = (out[0].float() - ref_dx.float()).abs().max().item() / scale
        dw_diff = (out[1].float() - ref[1].float()).abs().max().item()
        rows.append(dict(docs=docs, walk=list(walk), walk_ms=ms, tiles_dpre_dx_ms=tiles_ms, dx_rel_diff=dx_diff,
                         dw_max_diff=dw_diff))
        print(f"  walk {walk[0]:3d} rows x {walk[1]:4d}, {walk[2]} warps: {ms * 1e3:7.1f} us against dpre + dx "
              f"{tiles_ms * 1e3:6.1f} us (dx {dx_diff:.2e} of its largest from the tiles' dx, dw max diff {dw_diff:.2e})")
    kernel.WALK_SPAN, kernel.WALK_BLOCK_C, kernel.WALK_WARPS = default_walk
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_short_conv")
    rows = []
    for docs in (False, True):
        rows += bench_case(docs, lambda fn: median_ms(fn, args.iters, args.warmup, host_ahead_ms=ONE_CALL_AHEAD_MS))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), shape=[B, T, C, W],
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
