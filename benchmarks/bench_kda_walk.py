"""KDA's forward state walk and output on one GPU: fla's two kernels (chunk_gated_delta_rule_fwd_h, then
chunk_gla_fwd_o_gk with its zero fill, as chunk_kda runs them) against moontrain's one (moontrain.model.kda.walk_kernel)
at the recipe's KDA call: B x T tokens, 16 heads of 128, with and without packed documents. The stage's inputs are
a real forward's (random_kda_inputs through moontrain's gate-and-norm kernel and fla's intra-chunk forward).

    python benchmarks/bench_kda_walk.py [--case 4x4096x16] [--doc-len 1024] [--bv 32] [--warps 4] [--stages 3]
        [--iters 20] [--warmup 3] [--out FILE]

Per row: the median device us (CUDA events, the host run ahead) of fla's two launches and of the one kernel for
each --bv x --warps x --stages (a tile whose stages do not fit shared memory is named and skipped), and beside
each variant the share of h, v_new and o elements bitwise fla's and the largest difference relative to fla's
largest value. A table is printed; --out writes JSON. GPU only.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_kda_intra_fwd import fla_stage
from benchmarks.bench_kda_intra_fwd import stage_inputs as intra_stage_inputs
from benchmarks.timing import kernel_bench_args, median_ms, sweep_tile, write_sweep
from moontrain.model.kda.chunk import _chunk_list
from moontrain.model.kda.walk_kernel import kda_forward_walk

HOST_AHEAD_MS = 5.0  # fla's wrappers and two launches: longer than one call's host work


def stage_inputs(B: int, T: int, H: int, doc_len: int | None) -> tuple[dict, dict]:
    """(the walk's inputs, fla's chunk lists) from a forward at random_kda_inputs' scales: bench_kda_intra_fwd's
    stage inputs through fla's intra-chunk forward."""
    from fla.ops.utils.index import prepare_chunk_offsets

    x = intra_stage_inputs(B, T, H, doc_len)
    cu, chunk_indices = x["cu_seqlens"], x["chunk_indices"]
    chunk_offsets = None
    if cu is not None:
        _, chunk_offsets = _chunk_list(x["q"].shape[1], cu, None, cu.numel() - 1)
        chunk_offsets = prepare_chunk_offsets(cu, 64) if chunk_offsets is None else chunk_offsets
    w, u, qg, kg, Aqk, _ = fla_stage(x)
    walk = dict(kg=kg, w=w, u=u, g=x["g"], qg=qg, Aqk=Aqk, scale=x["scale"], cu_seqlens=cu,
                chunk_offsets=chunk_offsets)
    lists = dict(cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, use_graph=cu is not None)
    return walk | dict(qn=x["q"]), lists


def fla_two(x: dict, lists: dict) -> tuple[torch.Tensor, ...]:
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=x["kg"], w=x["w"], u=x["u"], gk=x["g"], chunk_size=64,
                                               cu_seqlens=lists["cu_seqlens"], chunk_indices=lists["chunk_indices"],
                                               chunk_offsets=lists["chunk_offsets"])
    o = chunk_gla_fwd_o_gk(q=x["qn"], v=v_new, g=x["g"], A=x["Aqk"], h=h, scale=x["scale"], chunk_size=64,
                           cu_seqlens=lists["cu_seqlens"], chunk_indices=lists["chunk_indices"],
                           use_graph=lists["use_graph"])
    return h, v_new, o


def compare(got: tuple, ref: tuple, n_h: int) -> tuple[list[float], float]:
    """(% of h's (its first n_h rows: the sequences' chunks), v_new's and o's elements bitwise fla's, the largest
    difference over fla's largest value)."""
    same, rel = [], 0.0
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        if i == 0:
            a, b = a[:, :n_h], b[:, :n_h]
        d = (a.float() - b.float()).abs()
        same.append(100 * (d == 0).float().mean().item())
        rel = max(rel, d.max().item() / b.float().abs().max().item())
    return same, rel


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_kda_walk", case=dict(default="4x4096x16"),
                             **{"doc-len": dict(type=int, default=1024)},
                             bv=dict(type=int, nargs="+", default=[32]), warps=dict(type=int, nargs="+", default=[4]),
                             stages=dict(type=int, nargs="+", default=[3]))
    B, T, H = (int(n) for n in args.case.split("x"))
    print(f"{'documents':<10} {'variant':<22} {'us':>8} {'bitwise h/v/o %':>18} {'max rel diff':>12}", flush=True)
    rows = []
    for doc_len in (None, args.doc_len):
        x, lists = stage_inputs(B, T, H, doc_len)
        walk_args = {n: x[n] for n in ("kg", "w", "u", "g", "qg", "Aqk", "scale", "cu_seqlens", "chunk_offsets")}
        rows_R = None if doc_len is None else lists["chunk_indices"].shape[0]
        ref = fla_two(x, lists)
        n_h = ref[0].shape[1] if doc_len is None else int(lists["chunk_offsets"][-1])
        docs = "none" if doc_len is None else str(doc_len)
        us = 1e3 * median_ms(lambda x=x, lists=lists: fla_two(x, lists), args.iters, args.warmup,
                             host_ahead_ms=HOST_AHEAD_MS)
        rows.append(dict(documents=docs, variant="fla fwd_h + fwd_o", us=us))
        print(f"{docs:<10} {'fla fwd_h + fwd_o':<22} {us:>8.1f}", flush=True)
        for bv, warps, stages in itertools.product(args.bv, args.warps, args.stages):
            def call(bv=bv, warps=warps, stages=stages, walk_args=walk_args, rows_R=rows_R):
                return kda_forward_walk(**walk_args, rows=rows_R, bv=bv, warps=warps, stages=stages)
            row = dict(documents=docs, variant=f"walk bv{bv} w{warps} s{stages}")
            rows.append(sweep_tile(call, lambda got, ref=ref, n_h=n_h: compare(got, ref, n_h), row, args,
                                   HOST_AHEAD_MS, (22, 18)))
    write_sweep(args.out, args.case, rows)


if __name__ == "__main__":
    main()
