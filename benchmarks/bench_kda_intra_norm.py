"""The KDA backward's last two launches on the gate-and-norm route, on one GPU: fla's intra-chunk kernel with 64-wide
K-blocks (kernels.kda_intra=fla_k64) then the ends' backward with the L2 norms (kda_gate_norm_backward), against
moontrain's fused stage (kernels.kda_intra=moontrain, moontrain.model.kda.intra_norm_kernel: the intra-chunk
stage and the norms' backward in one kernel) then the gate's backward alone (kda_gate_backward), at the recipe's
KDA call: B x T tokens, 16 heads of 128, the stage's inputs at fla's scales (moontrain.model.kda.intra's
random_stage_inputs), with and without packed documents.

    python benchmarks/bench_kda_intra_norm.py [--case 4x4096x16] [--doc-len 1024] [--diag tf32 ieee tf32x3]
        [--warps 4] [--stages 3] [--maxnreg 0 168 128] [--iters 20] [--warmup 3] [--out FILE]

Per row: the median device us (CUDA events, the host run ahead) of fla_k64's stage alone and with the ends'
backward, and of the fused kernel alone and with the gate's backward for each --diag (the diagonal blocks'
input_precision) x --warps x --stages x --maxnreg (ptxas's register cap a thread; 0: uncapped); beside
each fused variant, its largest difference from the float64 specification (moontrain.model.kda.intra_norm) on a
smaller case with weak gates (0.1 nats a token, where the terms between sub-chunks count) relative to each
output's largest magnitude. A table is printed; --out writes JSON. GPU only.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import kernel_bench_args, median_ms
from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.gate_norm_kernel import kda_gate_backward, kda_gate_norm_backward
from moontrain.model.kda.intra import random_stage_inputs
from moontrain.model.kda.intra_fla import kda_intra_fla
from moontrain.model.kda.intra_norm import STAGE_OUTPUTS, kda_intra_norm_reference
from moontrain.model.kda.intra_norm_kernel import kda_intra_norm

K = 128
HOST_AHEAD_MS = 5.0  # two launches and fla's wrapper: longer than one call's host work
STAGE = ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg")


def _inputs(B: int, T: int, H: int, doc_len: int | None, gate: float = 5.0, seed: int = 0) -> dict:
    """The stage's inputs with the forward's reciprocal norms and the gate's f, A_log, dt_bias."""
    lists = {}
    if doc_len is not None:
        B, T = 1, B * T
        cu = torch.arange(0, T + 1, doc_len, device="cuda")
        cu = torch.cat([cu, cu.new_tensor([T])]) if cu[-1] != T else cu
        lists = dict(cu_seqlens=cu, chunk_indices=prepare_chunk_indices(cu))
    x = random_stage_inputs(B, T, H, K, torch.bfloat16, "cuda", seed=seed, gate=gate, **lists)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x |= {n: torch.rand(B, T, H, device="cuda", generator=gen) + 0.5 for n in ("q_rstd", "k_rstd")}
    x |= dict(f=torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=gen),
              A_log=torch.rand(H, device="cuda", generator=gen),
              dt_bias=torch.randn(H * K, device="cuda", generator=gen))
    return x


def _lists(x: dict) -> dict:
    return dict(lower_bound=x["lower_bound"], cu_seqlens=x["cu_seqlens"], chunk_indices=x["chunk_indices"])


def _fla_stage(x: dict) -> tuple[torch.Tensor, ...]:
    return kda_intra_fla(**{n: x[n] for n in STAGE}, safe_gate=True, **_lists(x))


def _fla_route(x: dict) -> tuple[torch.Tensor, ...]:
    dq, dk, _, dg = _fla_stage(x)
    return kda_gate_norm_backward(dq, dk, dg, x["q"], x["q_rstd"], x["k"], x["k_rstd"], x["f"], x["A_log"],
                                  x["dt_bias"], **_lists(x))


def _fused_stage(x: dict, variant: dict) -> tuple[torch.Tensor, ...]:
    return kda_intra_norm(*(x[n] for n in STAGE), x["q_rstd"], x["k_rstd"], **_lists(x), **variant)


def _fused_route(x: dict, variant: dict) -> tuple[torch.Tensor, ...]:
    dg = _fused_stage(x, variant)[3]
    return kda_gate_backward(dg, x["f"], x["A_log"], x["dt_bias"], **_lists(x))


def _errors(variant: dict) -> dict:
    """The variant's largest differences from the float64 specification, weak gates, 2 x 1000 tokens."""
    x = _inputs(2, 1000, 16, None, gate=0.1, seed=3)
    wide = {n: x[n].double() for n in (*STAGE, "q_rstd", "k_rstd")}
    want = kda_intra_norm_reference(*(wide[n] for n in (*STAGE, "q_rstd", "k_rstd")), **_lists(x))
    got = _fused_stage(x, variant)
    return {n: ((a.double() - b).abs().max() / b.abs().max()).item()
            for n, a, b in zip(STAGE_OUTPUTS, got, want, strict=True)}


def _cap(maxnreg: int | str | None) -> str:
    """The table's register cap column: the launcher's default, uncapped, or the cap; '-' for fla's rows."""
    return {None: "def", 0: "none", "": "-"}.get(maxnreg, str(maxnreg))


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_kda_intra_norm",
                             case=dict(default="4x4096x16", help="BxTxH (KDA heads of 128)"),
                             **{"doc-len": dict(type=int, default=1024)},
                             diag=dict(nargs="+", default=["tf32", "ieee"], choices=["tf32", "ieee", "tf32x3"]),
                             warps=dict(type=int, nargs="+", default=[4]),
                             maxnreg=dict(type=int, nargs="+", default=[-1],
                                          help="ptxas's register cap a thread; 0: uncapped, -1: the launcher's"),
                             stages=dict(type=int, nargs="+", default=[3]))
    B, T, H = (int(v) for v in args.case.split("x"))
    variants = [dict(diag=d, warps=w, stages=s, maxnreg=None if r < 0 else r)
                for d, w, s, r in itertools.product(args.diag, args.warps, args.stages, args.maxnreg)]
    errors = {str(v): _errors(v) for v in variants}
    rows = []
    for doc_len in (None, args.doc_len):
        x = _inputs(B, T, H, doc_len)

        def us(fn) -> float:
            return median_ms(fn, args.iters, args.warmup, host_ahead_ms=HOST_AHEAD_MS) * 1e3

        rows.append(dict(documents=doc_len, route="fla_k64", stage_us=us(lambda: _fla_stage(x)),  # noqa: B023
                         route_us=us(lambda: _fla_route(x))))  # noqa: B023
        for v in variants:
            rows.append(dict(documents=doc_len, route="fused", **v, errors=errors[str(v)],
                             stage_us=us(lambda: _fused_stage(x, v)),  # noqa: B023
                             route_us=us(lambda: _fused_route(x, v))))  # noqa: B023
    print(f"{args.case}: the stage alone and with the last launch (us, device alone); fused: largest difference "
          "from the float64 specification (weak gates)")
    print(f"{'docs':>5} {'route':>8} {'diag':>6} {'warps':>5} {'stages':>6} {'regs':>4} | {'stage':>8} {'+ last':>8} | "
          "errors")
    for r in rows:
        errs = " ".join(f"{n} {e:.1e}" for n, e in r.get("errors", {}).items())
        print(f"{r['documents'] or '-':>5} {r['route']:>8} {r.get('diag', '-'):>6} {r.get('warps', '-'):>5} "
              f"{r.get('stages', '-'):>6} {_cap(r.get('maxnreg', '')):>4} | {r['stage_us']:8.1f} "
              f"{r['route_us']:8.1f} | {errs}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  case=args.case, rows=rows), indent=1))


if __name__ == "__main__":
    main()
