"""KDA's forward intra-chunk stage on one GPU: fla's chunk_kda_fwd_intra (three launches and a zero fill, as
chunk_kda runs it with safe_gate and disable_recompute) against moontrain's two launches
(moontrain.model.kda.intra_fwd_kernel: fla's diagonal-block kernel, then one for the rest) at the recipe's KDA
call: B x T tokens, 16 heads of 128, with and without packed documents. The stage's inputs are a real forward's
(random_kda_inputs through moontrain's gate-and-norm kernel).

    python benchmarks/bench_kda_intra_fwd.py [--case 4x4096x16] [--doc-len 1024] [--bk 32] [--bv 64] [--warps 1]
        [--stages 1] [--iters 20] [--warmup 3] [--out FILE]

Per row: the median device us (CUDA events, the host run ahead) of fla's stage and of the kernel for each
--bk x --bv x --warps x --stages (a tile that does not fit is named and skipped), and beside each variant the
share of w, u, qg, kg, Aqk and Akk elements bitwise fla's (Aqk on and below its diagonal: fla leaves the blocks
above unwritten) and the largest difference relative to fla's largest value. A table is printed; --out writes
JSON. GPU only.
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import kernel_bench_args, median_ms, sweep_tile, write_sweep
from moontrain.model.kda.chunk import _chunk_list
from moontrain.model.kda.gate_norm_kernel import kda_gate_norm
from moontrain.model.kda.intra_fwd import STAGE_OUTPUTS, on_or_below_diagonal
from moontrain.model.kda.intra_fwd_kernel import kda_intra_forward
from moontrain.model.kda.ops import random_kda_inputs

HOST_AHEAD_MS = 5.0  # fla's wrapper: three launches, a fill and its allocations


def stage_inputs(B: int, T: int, H: int, doc_len: int | None) -> dict:
    """The stage's inputs (kda_intra_forward's keywords) from random_kda_inputs through the gate-and-norm kernel."""
    leaves, kw, _ = random_kda_inputs(B, T, H, 128, doc_len=doc_len)
    q, k, v, f, beta = (t.detach() for t in leaves)
    cu = cu_cpu = None
    if doc_len is not None:
        cu, cu_cpu = kw["seq_bounds"]
        q, k, v, f, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, f, beta))
    chunk_indices, _ = _chunk_list(q.shape[1], cu, cu_cpu, None if cu is None else cu_cpu.numel() - 1)
    qn, _, kn, _, g = kda_gate_norm(q, k, f, kw["A_log_H"], kw["dt_bias_HK"].flatten(),
                                    lower_bound=kw["lower_bound"], cu_seqlens=cu, chunk_indices=chunk_indices)
    return dict(q=qn, k=kn, v=v.contiguous(), g=g, beta=beta.contiguous(), scale=kw["scale"], cu_seqlens=cu,
                chunk_indices=chunk_indices)


def fla_stage(x: dict) -> tuple[torch.Tensor, ...]:
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q=x["q"], k=x["k"], v=x["v"], gk=x["g"], beta=x["beta"],
                                                 scale=x["scale"], cu_seqlens=x["cu_seqlens"], chunk_size=64,
                                                 chunk_indices=x["chunk_indices"], safe_gate=True,
                                                 disable_recompute=True, use_graph=x["cu_seqlens"] is not None)
    return w, u, qg, kg, Aqk, Akk


def compare(got: tuple, ref: tuple, cu_seqlens: torch.Tensor | None) -> tuple[list[float], float]:
    """(% of each output's elements bitwise fla's, the largest difference over fla's largest value)."""
    same, rel = [], 0.0
    for name, a, b in zip(STAGE_OUTPUTS, got, ref, strict=True):
        a, b = a.float(), b.float()
        if name == "Aqk":  # fla writes the blocks on and below the diagonal only
            lower = on_or_below_diagonal(a, cu_seqlens)
            a, b = torch.where(lower, a, 0.0), torch.where(lower, b, 0.0)
        d = (a - b).abs()
        same.append(100 * (d == 0).float().mean().item())
        rel = max(rel, d.max().item() / b.abs().max().item())
    return same, rel


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_kda_intra_fwd", case=dict(default="4x4096x16"),
                             **{"doc-len": dict(type=int, default=1024)},
                             bk=dict(type=int, nargs="+", default=[32]), bv=dict(type=int, nargs="+", default=[64]),
                             warps=dict(type=int, nargs="+", default=[1]),
                             stages=dict(type=int, nargs="+", default=[1]))
    B, T, H = (int(n) for n in args.case.split("x"))
    print(f"{'documents':<10} {'variant':<26} {'us':>8} {'bitwise w/u/qg/kg/Aqk/Akk %':>34} {'max rel diff':>12}",
          flush=True)
    rows = []
    for doc_len in (None, args.doc_len):
        x = stage_inputs(B, T, H, doc_len)
        ref = fla_stage(x)
        docs = "none" if doc_len is None else str(doc_len)
        us = 1e3 * median_ms(lambda x=x: fla_stage(x), args.iters, args.warmup, host_ahead_ms=HOST_AHEAD_MS)
        rows.append(dict(documents=docs, variant="fla chunk_kda_fwd_intra", us=us))
        print(f"{docs:<10} {'fla chunk_kda_fwd_intra':<26} {us:>8.1f}", flush=True)
        for bk, bv, warps, stages in itertools.product(args.bk, args.bv, args.warps, args.stages):
            def call(bk=bk, bv=bv, warps=warps, stages=stages, x=x):
                return kda_intra_forward(**x, bk=bk, bv=bv, warps=warps, stages=stages)
            row = dict(documents=docs, variant=f"two bk{bk} bv{bv} w{warps} s{stages}")
            check = functools.partial(compare, ref=ref, cu_seqlens=x["cu_seqlens"])
            rows.append(sweep_tile(call, check, row, args, HOST_AHEAD_MS, (26, 34)))
    write_sweep(args.out, args.case, rows)


if __name__ == "__main__":
    main()
