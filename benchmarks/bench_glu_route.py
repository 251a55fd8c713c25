"""moonep's gated-activation kernels on one GPU at k3_small's shapes: the routed experts' fused backward
(moonep.kernels.glu_route on the halves of the merged gate|up rows, as expert_glu calls it: the activation's
grads, the route-weighted activation and the route weights' grad)
the SiTU-GLU forward on the merged rows (moonep.kernels.glu_rows, as expert_glu calls it) and the flat SiTU-GLU
forward (moonep.kernels.situ_glu through glu_launch, the shared experts' and dense FFNs'), each over a sweep of
its tiles (the row kernels' last row: the tiles glu_route.backward_tiles picks for that F).

    python benchmarks/bench_glu_route.py [--iters 20] [--warmup 3] [--out bench_glu_route.json]

Shapes (rows x F, bf16, SiTU-GLU): the routed experts of one pass at 4 x 4096 tokens, top-8 and padding
(132,032 x 896), the two shared experts (16,384 x 1,792) and the dense FFN (16,384 x 5,632). Per tile: the
median ms of CUDA-event timings (the device's time: the host launches ahead), the HBM rate its traffic implies
(backward: g, h, u read and grad_h, grad_u, a_w written, 12 bytes an element; forwards: 6), and whether its
outputs equal the first tile's (elementwise outputs bitwise; the route weights' grad, a row sum in fp32, to its
summation order). GPU only.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import moonep.kernels.glu_launch as launch
import moonep.kernels.glu_route as route
import moonep.kernels.glu_rows as glu_rows
from benchmarks.timing import ONE_CALL_AHEAD_MS, kernel_bench_args, median_ms
from moonep.kernels.situ_glu import situ_glu_forward

SHAPES = {"routed": (132032, 896), "shared": (16384, 1792), "dense": (16384, 5632)}
# BLOCK_R, BLOCK_F, warps; the first is the reference the others are compared with
BWD_TILES = [(2, 1024, 4), (4, 256, 4), (1, 1024, 4), (8, 128, 4), (16, 128, 8), (4, 128, 4), (8, 128, 8),
             (16, 64, 4), (8, 256, 8), (16, 256, 8), (4, 512, 4)]
ROWS_FWD_TILES = BWD_TILES  # the merged rows' forward
FWD_TILES = [(2048, 8), (1024, 4), (4096, 8), (8192, 16), (2048, 4)]  # BLOCK, warps; the first is the default


def inputs(rows: int, F: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, u, g = (torch.randn(rows, F, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    w = torch.rand(rows, device="cuda", generator=gen)
    return g, h, u, w


def merged_inputs(rows: int, F: int) -> tuple[torch.Tensor, ...]:
    """g, hu (expert_glu's merged gate|up output [rows, 2F]) and w."""
    g, h, u, w = inputs(rows, F)
    return g, torch.cat([h, u], dim=1), w


def row_tiles(module, tiles: list[tuple[int, int, int]], call, label: str, iters: int, warmup: int):
    """For each tile: (tile, call()'s outputs, median ms), with module.backward_tiles patched to return the tile
    (the row kernels' tile choice); a tile Triton cannot compile is reported and skipped."""
    default = module.backward_tiles
    try:
        for tile in tiles:
            module.backward_tiles = lambda _F, tile=tile: tile
            try:
                got = call()
            except Exception as err:  # the sweep goes on
                print(f"  {label} {tile}: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
                continue
            yield tile, got, median_ms(call, iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
    finally:
        module.backward_tiles = default


def sweep_backward(name: str, rows: int, F: int, iters: int, warmup: int) -> list[dict]:
    g, hu, w = merged_inputs(rows, F)
    ref, out = None, []
    call = functools.partial(route.glu_route_backward_rows, "situ_glu", g, hu, w)
    for tile, got, ms in row_tiles(route, [*BWD_TILES, route.backward_tiles(F)], call, f"bwd {name}", iters, warmup):
        ref = got if ref is None else ref
        same = all(torch.equal(a, b) for a, b in zip(got[:2], ref[:2], strict=True))
        gw_diff = (got[2] - ref[2]).abs().max().item()
        gbs = 12 * rows * F / ms / 1e6
        out.append(dict(kernel="glu_route_backward", shape=name, rows=rows, F=F, tile=list(tile), ms=ms,
                        gb_per_s=gbs, bitwise=same, grad_w_max_diff=gw_diff))
        print(f"  bwd {name:<6} {tile[0]:3d} x {tile[1]:4d}, {tile[2]:2d} warps: {ms * 1e3:7.1f} us "
              f"({gbs:6.0f} GB/s; grads bitwise {same}, grad_w max diff {gw_diff:.1e})", flush=True)
    return out


def sweep_rows_forward(name: str, rows: int, F: int, iters: int, warmup: int) -> list[dict]:
    _, hu, _ = merged_inputs(rows, F)
    ref, out = None, []
    call = functools.partial(glu_rows.glu_forward_rows, "situ_glu", hu)
    tiles = [*ROWS_FWD_TILES, glu_rows.backward_tiles(F)]
    for tile, got, ms in row_tiles(glu_rows, tiles, call, f"rows fwd {name}", iters, warmup):
        ref = got if ref is None else ref
        gbs = 6 * rows * F / ms / 1e6
        same = torch.equal(got, ref)
        out.append(dict(kernel="glu_forward_rows", shape=name, rows=rows, F=F, tile=list(tile), ms=ms,
                        gb_per_s=gbs, bitwise=same))
        print(f"  rows fwd {name:<6} {tile[0]:3d} x {tile[1]:4d}, {tile[2]:2d} warps: {ms * 1e3:7.1f} us "
              f"({gbs:6.0f} GB/s; bitwise {same})", flush=True)
    return out


def sweep_forward(name: str, rows: int, F: int, iters: int, warmup: int) -> list[dict]:
    _, h, u, _ = inputs(rows, F)
    default = (launch._BLOCK, launch._WARPS)
    ref = None
    out = []
    for tile in FWD_TILES:
        launch._BLOCK, launch._WARPS = tile
        got = situ_glu_forward(h, u)
        ref = got if ref is None else ref
        ms = median_ms(lambda: situ_glu_forward(h, u), iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
        gbs = 6 * rows * F / ms / 1e6
        out.append(dict(kernel="situ_glu_forward", shape=name, rows=rows, F=F, tile=list(tile), ms=ms,
                        gb_per_s=gbs, bitwise=torch.equal(got, ref)))
        print(f"  fwd {name:<6} {tile[0]:5d}, {tile[1]:2d} warps: {ms * 1e3:7.1f} us ({gbs:6.0f} GB/s; bitwise "
              f"{torch.equal(got, ref)})", flush=True)
    launch._BLOCK, launch._WARPS = default
    return out


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_glu_route")
    rows = []
    for name, (n, F) in SHAPES.items():
        rows += sweep_backward(name, n, F, args.iters, args.warmup)
        rows += sweep_rows_forward(name, n, F, args.iters, args.warmup)
        rows += sweep_forward(name, n, F, args.iters, args.warmup)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
