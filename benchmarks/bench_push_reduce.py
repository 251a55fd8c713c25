"""combine's destination push on one GPU: the plain push against combine_reduce "destination"'s
chain lists + reduce push, over the reduce push's block shapes.

    python benchmarks/bench_push_reduce.py [--shapes k3_small_moe k3] [--iters 20] [--out DIR]

Shapes (this GPU as one destination rank; the sources' landing rows are local tensors, so the
stores go to HBM instead of NVLink: the kernels' own cost):
    k3_small       R 1, S 16384 tokens, H 1024 (the latent), K 8, E 64: recipes/k3_small.yaml's MoE layer at
                   one rank, one pass of 4 x 4096 tokens
    k3_small_moe   R 1, S 32768 tokens, H 2048, K 8, E 64: every token's 8 rows here (1 in 8 rows a
                   primary, chains of 8)
    k3             R 8, S 8192 tokens per source, H 3584 (latent), K 16, E 896: this rank holds experts
                   0..111 of every source's tokens (chains of ~2)
Routing from moonep.routing.generate_routing (--maxvio), rows grouped by expert as a dispatch leaves
them, row_src / row_chain as the scatter writes them.

Cases (CUDA events, median of --iters after --warmup, the device's time alone):
    push plain       _push_kernel, y's rows into their landing rows (combine_reduce "source")
    chain lists      _chain_list_kernel alone
    reduce fwd       chain lists + _push_reduce_kernel with row_weights (the MoE forward's call)
    reduce bwd       chain lists + _push_reduce_kernel with add_rows and row scalars (the backward's)
for each reduce push block shape --configs (tile elements, hidden width at most, warps, programs per
SM). GB/s counts the bytes the kernel must move: rows read (y, add_rows) + landing rows written.
Every reduce configuration's landing rows and scalars are checked bitwise against a PyTorch sum of
each token's rows in ascending k (moonep.datapath.reference.row_values). Table printed; JSON written
to --out after every shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import ONE_CALL_AHEAD_MS, median_ms
from moonep.datapath.reference import row_values
from moonep.kernels import dispatch_combine as dc
from moonep.routing import generate_routing

SHAPES = {
    "k3_small": dict(R=1, S=16384, H=1024, K=8, E=64),
    "k3_small_moe": dict(R=1, S=32768, H=2048, K=8, E=64),
    "k3": dict(R=8, S=8192, H=3584, K=16, E=896),
}
# (tile elements, hidden width at most, warps, programs per SM); the first is the library's default
CONFIGS = [(4096, 512, 16, 1), (4096, 512, 16, 2), (4096, 512, 16, 3), (4096, 512, 16, 4), (8192, 512, 16, 1),
           (8192, 1024, 16, 1), (8192, 1024, 16, 2), (16384, 512, 16, 1), (4096, 1024, 16, 2), (4096, 1024, 8, 2),
           (4096, 1024, 8, 4), (2048, 256, 8, 2), (2048, 512, 4, 8), (4096, 512, 8, 2), (4096, 512, 8, 4),
           (8192, 1024, 8, 1)]


def build(R: int, S: int, H: int, K: int, E: int, maxvio: float, seed: int, dev: torch.device) -> dict:
    """One destination's receive rows: rows grouped by expert (then source rank, token), row_src and
    row_chain as the scatter writes them, and the rows' values."""
    topk_RsK = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio,
                                seed=seed, device=dev).topk_RsK.long()
    epn = E // R
    here = topk_RsK < epn  # this rank: home of experts 0 .. epn - 1
    src_rank, t, k = here.nonzero(as_tuple=True)
    order = torch.argsort((topk_RsK[src_rank, t, k] * R + src_rank) * S + t, stable=True)
    src_rank, t, k = src_rank[order], t[order], k[order]
    n = src_rank.numel()
    rows = torch.arange(n, device=dev)
    table = torch.full((R * S, K), -1, dtype=torch.long, device=dev)  # the rows of each (source, token) by k
    table[src_rank * S + t, k] = rows
    nxt = torch.full_like(table, -1)  # the next row of the same token at a later k
    for j in range(K - 2, -1, -1):
        nxt[:, j] = torch.where(table[:, j + 1] >= 0, table[:, j + 1], nxt[:, j + 1])
    earlier = torch.cumsum((table >= 0).long(), 1) - (table >= 0).long()  # rows at earlier k
    row_link = torch.zeros(n + 1, 2, dtype=torch.int32, device=dev)
    row_link[:n, 0] = rows.int()
    row_link[:n, 1] = (src_rank * S * K + t * K + k).int()
    row_link[n, 1] = -1
    row_chain = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    row_chain[:n] = (2 * nxt[src_rank * S + t, k] + (earlier[src_rank * S + t, k] == 0).long()).int()
    g = torch.Generator(device=dev).manual_seed(seed)
    y = torch.randn(n + 1, H, generator=g, device=dev).to(torch.bfloat16)
    add = torch.randn(n + 1, H, generator=g, device=dev).to(torch.bfloat16)
    w = torch.rand(n + 1, generator=g, device=dev)
    scal = torch.randn(n + 1, generator=g, device=dev)
    return dict(n=n, table=table, row_link=row_link, row_chain=row_chain, y=y, add=add, w=w, scal=scal,
                primaries=int((table >= 0).any(1).sum()))


def reference_land(d: dict, R: int, S: int, H: int, K: int, w: torch.Tensor | None, add: torch.Tensor | None
                   ) -> torch.Tensor:
    """land [R, S*K + 1, H]: each token's rows here summed in fp32, ascending k, in its first entry's row."""
    vals = row_values(d["y"], w, add)
    table = d["table"]
    acc = torch.zeros(table.shape[0], H, dtype=torch.float32, device=vals.device)
    have = torch.zeros(table.shape[0], dtype=torch.bool, device=vals.device)
    first_k = torch.full((table.shape[0],), -1, dtype=torch.long, device=vals.device)
    for j in range(K):
        p = table[:, j] >= 0
        v = vals[table[:, j].clamp(min=0)]
        acc = torch.where((p & have)[:, None], acc + v, torch.where(p[:, None], v, acc))
        first_k = torch.where(p & ~have, j, first_k)
        have |= p
    land = torch.zeros(R, S * K + 1, H, dtype=torch.bfloat16, device=vals.device)
    tok = have.nonzero(as_tuple=True)[0]
    land[tok // S, (tok % S) * K + first_k[tok]] = acc[tok].to(torch.bfloat16)
    return land


def reference_scalars(d: dict, R: int, S: int, K: int) -> torch.Tensor:
    """land_scalar [R, S*K + 1]: every row's scalar in its own entry's slot."""
    out = torch.zeros(R, S * K + 1, device=d["scal"].device)
    src = d["row_link"][: d["n"], 1].long()
    out[src // (S * K), src % (S * K)] = d["scal"][: d["n"]]
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def run_shape(name: str, args: argparse.Namespace, sms: int) -> list[dict]:
    R, S, H, K, E = (SHAPES[name][x] for x in ("R", "S", "H", "K", "E"))
    d = build(R, S, H, K, E, args.maxvio, args.seed, torch.device("cuda"))
    n, SK = d["n"], S * K
    land = torch.zeros(R, SK + 1, H, dtype=torch.bfloat16, device="cuda")
    land_scal = torch.zeros(R, SK + 1, device="cuda")
    scratch = dc.chain_scratch(n + 1, K, land.device)
    want_fwd = reference_land(d, R, S, H, K, d["w"], None)
    want_bwd = reference_land(d, R, S, H, K, None, d["add"])
    want_scal = reference_scalars(d, R, S, K)
    row_bytes = H * 2
    rows = []

    def record(case: str, config: str, ms: float, nbytes: int, ok: str) -> None:
        rows.append(dict(shape=name, case=case, config=config, ms=ms, GBps=nbytes / (ms * 1e-3) / 1e9, check=ok,
                         rows=n, primaries=d["primaries"]))
        print(f"{name:>13} {case:>12} {config:>22} {ms * 1e3:9.1f} us {rows[-1]['GBps']:8.0f} GB/s  {ok}", flush=True)

    ms = median_ms(lambda: dc.push(d["y"], None, d["row_link"], n, land, land_scal, SK, sms), args.iters,
                   args.warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
    record("push plain", "-", ms, 2 * n * row_bytes, "-")
    ms = median_ms(lambda: dc.chain_lists(d["row_link"], d["row_chain"], n, *scratch), args.iters, args.warmup,
                   host_ahead_ms=ONE_CALL_AHEAD_MS)
    record("chain lists", "-", ms, n * 8 + n * K * 4, "-")
    defaults = (dc._REDUCE_PUSH_MAX_H, dc._REDUCE_PUSH_WARPS, dc._REDUCE_PUSH_PER_SM)
    try:
        for tile, max_h, warps, per_sm in CONFIGS:
            dc._REDUCE_PUSH_MAX_H, dc._REDUCE_PUSH_WARPS, dc._REDUCE_PUSH_PER_SM = max_h, warps, per_sm
            config = f"{tile}/{max_h}/{warps}w/{per_sm}xSM"
            for case, kwargs, want, nbytes in (
                    ("reduce fwd", dict(row_weights=d["w"]), want_fwd, (n + d["primaries"]) * row_bytes),
                    ("reduce bwd", dict(add_rows=d["add"], row_scalars=d["scal"]), want_bwd,
                     (2 * n + d["primaries"]) * row_bytes)):
                scal = kwargs.pop("row_scalars", None)

                def call(kwargs=kwargs, scal=scal, tile=tile) -> None:
                    dc.push(d["y"], scal, d["row_link"], n, land, land_scal, SK, sms,
                            row_chain=d["row_chain"], scratch=scratch, reduce_tile=tile, **kwargs)

                land.zero_()
                land_scal.zero_()
                call()
                ok = same_bits(land, want) and (scal is None or same_bits(land_scal, want_scal))
                ms = median_ms(call, args.iters, args.warmup, host_ahead_ms=ONE_CALL_AHEAD_MS)
                record(case, config, ms, nbytes, "bitwise" if ok else "MISMATCH")
    finally:
        dc._REDUCE_PUSH_MAX_H, dc._REDUCE_PUSH_WARPS, dc._REDUCE_PUSH_PER_SM = defaults
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--maxvio", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for bench_push_reduce_<date>.json")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, sms=sms, maxvio=args.maxvio,
                  configs=["tile/max_h/warps/programs per SM: " + "; ".join(map(str, CONFIGS))], rows=[])
    print(f"{'shape':>13} {'case':>12} {'config':>22} {'time':>12} {'bandwidth':>13}  check")
    for name in args.shapes:
        result["rows"] += run_shape(name, args, sms)
        if args.out:
            out = Path(args.out) / f"bench_push_reduce_{time.strftime('%Y%m%d')}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
    if any(r["check"] == "MISMATCH" for r in result["rows"]):
        sys.exit("a reduce push configuration differs from the PyTorch sum (MISMATCH above)")


if __name__ == "__main__":
    main()
