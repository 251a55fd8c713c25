"""KDA's intra-chunk backward stage (fla's chunk_kda_bwd_intra) timed over its K-block width: fla's wrapper fixes
BK = 32 (the kernel's autotuner searches only warps and stages), so each program re-reads its chunk's [16, 16]
dA tiles and its gates K / 32 times. This launches fla's kernel as its wrapper does with BK in --bk
(moontrain.model.kda.intra_fla, kernels.kda_intra=fla_k64 at BK 64), beside fla's own call, on the stage's inputs
captured from a real chunk_kda backward (one KDA layer call at B x T x H heads of 128, with and without packed
documents).

    python benchmarks/diagnostics/kda_intra_tiles.py [--case 4x4096x16] [--doc-len 1024] [--bk 32 64 128]
        [--iters 30] [--warmup 5] [--out kda_intra_tiles.json]

Per row: the median of --iters CUDA-event timings of the stage's call (the wrapper's allocations and db's sum
included), and the largest difference of each output from fla's own call relative to that output's largest
value (dq, dk, dg sum over the chunk's rows, which the K-block does not touch: expected bitwise; db's K-block
partials are summed in a different grouping). GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.kda.ops import kda_fla, random_kda_inputs

OUTPUTS = ("dq", "dk", "db", "dg")


def capture(B: int, T: int, H: int, doc_len: int | None) -> dict:
    """The keyword arguments of the chunk_kda_bwd_intra call one chunk_kda backward makes."""
    import fla.ops.kda.chunk_bwd as chunk_bwd

    seen: dict = {}
    original = chunk_bwd.chunk_kda_bwd_intra

    def record(**kwargs):
        seen.update(kwargs)
        return original(**kwargs)

    leaves, kwargs, go = random_kda_inputs(B, T, H, 128, doc_len=doc_len)
    chunk_bwd.chunk_kda_bwd_intra = record
    try:
        o = kda_fla(*leaves, **kwargs)
        torch.autograd.grad(o, leaves, go)
    finally:
        chunk_bwd.chunk_kda_bwd_intra = original
    torch.cuda.synchronize()
    if not seen:
        raise SystemExit("chunk_kda's backward made no chunk_kda_bwd_intra call (is fla-core 0.6.0 installed?)")
    return seen


def variants(bks: list[int]) -> dict:
    """{row name: the stage's callable on its keyword arguments}."""
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    from moontrain.model.kda.intra_fla import kda_intra_fla

    rows = {"fla (BK 32, its call)": lambda kw: chunk_kda_bwd_intra(**kw)}
    rows.update({f"fla's kernel, BK {bk}": (lambda kw, bk=bk: kda_intra_fla(**kw, block_k=bk)) for bk in bks})
    return rows


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() or 1.0
    return (a.float() - b.float()).abs().max().item() / scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="4x4096x16", help="B x T x heads (heads of 128)")
    p.add_argument("--doc-len", type=int, default=1024, help="the documents row's document length")
    p.add_argument("--bk", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kda_intra_tiles.py times GPU kernels: no CUDA device here")
    B, T, H = (int(x) for x in a.case.split("x"))
    rows = []
    print(f"{'case':<10} {'variant':<26} {'ms':>7}  max |diff| / max |fla| (dq, dk, db, dg)", flush=True)
    for doc_len in (None, a.doc_len):
        kw = capture(B, T, H, doc_len)
        ref = None
        for name, fn in variants(a.bk).items():
            try:
                got = fn(kw)
            except Exception as err:  # a variant that fails is reported, the others still run
                print(f"{'docs' if doc_len else 'rows':<10} {name:<26} {type(err).__name__}: "
                      f"{str(err).splitlines()[0][:100]}", flush=True)
                continue
            ref = got if ref is None else ref
            diffs = [rel_diff(x, r) for x, r in zip(got, ref, strict=True)]
            ms = median_ms(lambda fn=fn, kw=kw: fn(kw), a.iters, a.warmup)
            rows.append(dict(case=a.case, doc_len=doc_len, variant=name, ms=ms,
                             rel_diff=dict(zip(OUTPUTS, diffs, strict=True))))
            print(f"{'docs' if doc_len else 'rows':<10} {name:<26} {ms:7.3f}  "
                  + ", ".join(f"{d:.1e}" for d in diffs), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
