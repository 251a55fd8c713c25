"""One AttnRes aggregation on one GPU at k3_small's shapes: the PyTorch math as train.compile runs it
(moontrain.model.attn_res.compiled_math) against the Triton kernels (moontrain.model.attn_res_kernel), forward
and backward, for N = 1..4 values (K3's 16 layers in blocks of 6 aggregate over 1 to 4), over a sweep of the
kernels' tiles.

    python benchmarks/bench_attn_res.py [--values 1 2 3 4] [--tiles 4x1024x4x4 2x2048x8x8 ...] [--programs 512 264]
                                        [--iters 20] [--warmup 3] [--out bench_attn_res.json]

Shape: 4 x 4096 tokens of D 2048, bf16. Per case: the median ms of CUDA-event timings (the device alone), the HBM
rate the least traffic implies (forward: N values read, h written; backward: gh and N values read, N grads
written; summed into: the step's backward, each grad added to a sum so far, so N sums read too; 2 bytes an
element), and the largest difference from the compiled math relative to its largest magnitude (h and the values'
grads; the query's grad separately). The step runs 33 aggregations a pass (docs/performance.md). GPU
only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import ONE_CALL_AHEAD_MS, kernel_bench_args, median_ms
from moontrain.model import attn_res, attn_res_kernel

B, T, D = 4, 4096, 2048
TILES = [(1, 2048, 4, 4), (4, 1024, 4, 4), (2, 2048, 4, 4), (2, 2048, 8, 8), (4, 2048, 8, 8), (2, 1024, 4, 4)]
# BLOCK_M, BLOCK_D, forward / backward warps (--tiles BMxBDxFWxBW replaces the list), each at every N; the shipped
# kernels, which pick the backward's tile by N, are timed first. --programs: the backward's most programs
# (BWD_PROGRAMS) to time each tile's backward at


def inputs(N: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(N)
    values = tuple((torch.randn(B, T, D, device="cuda", generator=gen) * (1 + 0.5 * i)).to(torch.bfloat16)
                   for i in range(N))
    query = (0.05 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
    key_weight = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16)
    grad_h = torch.randn(B, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    return query, key_weight, values, grad_h


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def case(N: int, iters: int, warmup: int, tiles: list[tuple[int, ...]], programs: list[int]) -> list[dict]:
    query, key_weight, values, grad_h = inputs(N)
    fwd, bwd = attn_res.compiled_math()
    h, r, p = fwd(query, key_weight, 1e-6, values)
    ref_b = bwd(query, key_weight, r, p, grad_h, values)
    gb_f, gb_b, gb_s = (2 * (N + 1) * B * T * D / 1e9, 2 * (2 * N + 1) * B * T * D / 1e9,
                        2 * (3 * N + 1) * B * T * D / 1e9)
    out = []
    ms_f = median_ms(lambda: fwd(query, key_weight, 1e-6, values), iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
    ms_b = median_ms(lambda: bwd(query, key_weight, r, p, grad_h, values), iters, warmup,
                     host_ahead_ms=ONE_CALL_AHEAD_MS)
    out.append(dict(N=N, impl="compiled torch", fwd_ms=ms_f, bwd_ms=ms_b, fwd_gb_s=gb_f / ms_f * 1e3,
                    bwd_gb_s=gb_b / ms_b * 1e3))
    print(f"  N {N}  compiled torch           fwd {ms_f * 1e3:7.1f} us ({gb_f / ms_f * 1e3:5.0f} GB/s)  "
          f"bwd {ms_b * 1e3:7.1f} us ({gb_b / ms_b * 1e3:5.0f} GB/s)", flush=True)
    saved = (attn_res_kernel.BLOCK_M, attn_res_kernel.BLOCK_D, attn_res_kernel.FWD_WARPS, attn_res_kernel.BWD_WARPS,
             attn_res_kernel.BWD_PROGRAMS, attn_res_kernel.BWD_MANY_N)
    # first the kernels as shipped (tile "shipped": the backward's tile by N), then each swept tile at every N
    for tile, progs in [(None, attn_res_kernel.BWD_PROGRAMS)] + [(t, n) for t in tiles for n in programs]:
        if tile is not None:
            (attn_res_kernel.BLOCK_M, attn_res_kernel.BLOCK_D, attn_res_kernel.FWD_WARPS, attn_res_kernel.BWD_WARPS,
             attn_res_kernel.BWD_PROGRAMS, attn_res_kernel.BWD_MANY_N) = (*tile, progs, attn_res_kernel.MAX_VALUES + 1)
        kf, kb = attn_res_kernel.depth_forward, attn_res_kernel.depth_backward
        h2, r2, p2 = kf(query, key_weight, 1e-6, values)
        got_b = kb(query, key_weight, r2, p2, grad_h, values)
        diff = max([rel(h2, h)] + [rel(a, b) for a, b in zip(got_b[2], ref_b[2], strict=True)])
        diff_q = max(rel(got_b[0], ref_b[0]), rel(got_b[1], ref_b[1]))
        ms_f = median_ms(lambda: kf(query, key_weight, 1e-6, values),  # noqa: B023 (called here)
                         iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
        ms_b = median_ms(lambda: kb(query, key_weight, r2, p2, grad_h, values),  # noqa: B023
                         iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
        # the step's usual call: every value's gradient added into a sum so far (attn_res.BlockGrad)
        sums = [torch.zeros_like(v) for v in values]
        ms_s = median_ms(lambda: kb(query, key_weight, r2, p2, grad_h, values, into=sums),  # noqa: B023
                         iters, warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
        out.append(dict(N=N, impl="triton", tile="shipped" if tile is None else list(tile), bwd_programs=progs,
                        fwd_ms=ms_f, bwd_ms=ms_b,
                        bwd_sum_into_ms=ms_s, fwd_gb_s=gb_f / ms_f * 1e3, bwd_gb_s=gb_b / ms_b * 1e3,
                        bwd_sum_into_gb_s=gb_s / ms_s * 1e3, rel_diff=diff, rel_diff_query=diff_q))
        name = "shipped           " if tile is None else f"{tile[0]:2d} x {tile[1]:4d}, {tile[2]}/{tile[3]} w"
        print(f"  N {N}  triton {name}, {progs:4d} p  "
              f"fwd {ms_f * 1e3:7.1f} us ({gb_f / ms_f * 1e3:5.0f} GB/s)  bwd {ms_b * 1e3:7.1f} us "
              f"({gb_b / ms_b * 1e3:5.0f} GB/s)  summed into {ms_s * 1e3:7.1f} us ({gb_s / ms_s * 1e3:5.0f} GB/s)  "
              f"rel diff {diff:.1e} (query {diff_q:.1e})", flush=True)
    (attn_res_kernel.BLOCK_M, attn_res_kernel.BLOCK_D, attn_res_kernel.FWD_WARPS, attn_res_kernel.BWD_WARPS,
     attn_res_kernel.BWD_PROGRAMS, attn_res_kernel.BWD_MANY_N) = saved
    return out


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_attn_res", values=dict(type=int, nargs="+", default=[1, 2, 3, 4],
                                                                   help="numbers of values N to time"),
                             tiles=dict(nargs="+", default=None, help="BMxBDxFWxBW tiles (default: TILES)"),
                             programs=dict(type=int, nargs="+", default=[attn_res_kernel.BWD_PROGRAMS],
                                           help="the backward's most programs (BWD_PROGRAMS)"))
    tiles = TILES if args.tiles is None else [tuple(int(x) for x in t.split("x")) for t in args.tiles]
    if any(len(t) != 4 for t in tiles):
        raise SystemExit(f"--tiles takes BMxBDxFWxBW (four integers), got {args.tiles}")
    src = torch.randn(B, T, D, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms_copy = median_ms(lambda: dst.copy_(src), args.iters, args.warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
    copy_gb_s = 2 * src.numel() * 2 / 1e9 / ms_copy * 1e3
    print(f"  a copy of one value (the HBM rate within reach): {ms_copy * 1e3:.1f} us ({copy_gb_s:.0f} GB/s)")
    rows = [dict(impl="copy", ms=ms_copy, gb_s=copy_gb_s)]
    for N in args.values:
        rows += case(N, args.iters, args.warmup, tiles, args.programs)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), shape=[B, T, D], rows=rows),
                                             indent=1))


if __name__ == "__main__":
    main()
