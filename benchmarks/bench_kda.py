"""Sequence mixing on one GPU: KDA (fla's chunk_kda through moontrain.model.kda.ops.kda_fla) against causal
softmax attention at MLA's head dims (q/k 192, v 128), forward + backward, with and without packed documents.

    python benchmarks/bench_kda.py [--iters 20] [--warmup 5] [--doc-len 1024] [--dqkg moontrain|fla]
        [--intra fla_k64|fla] [--out results/bench_kda.json]

Cases (batch x seq x heads, KDA heads of 128): T = 4k, 8k and 32k at k3_small's 16 heads by default (4 x 4096 x 16,
2 x 8192 x 16, 1 x 32768 x 16; fla's tiles for 16 heads are shipped); --cases 2x8192x32 for 32 heads, whose tiles
fla searches for minutes on a fresh cache.
Per case:
- kda: kda_fla on fla's ends (fla's chunk_kda: gate, L2 norm and chunked recurrence fused, kernels.kda_gate_norm=
  fla; the forward's states kept for the backward, kernels.kda_recompute=False; the dqkg stage on --dqkg's kernel,
  default moontrain's as kernels.kda_dqkg, the intra-chunk stage on --intra's, default fla_k64, what
  kernels.kda_intra=auto runs there; bf16 q/k/v/f, fp32 beta), grads of all inputs.
- kda docs: the same with a document start every --doc-len tokens (cu_seqlens over the flattened batch).
- sdpa: F.scaled_dot_product_attention, causal, bf16 (the MLA layers without document masking).
- flex docs: the compiled flex_attention with the same documents' block mask (the MLA layers' CUDA path).
- kda recompute (docs): the first case's kda rows with kernels.kda_recompute=True (the backward recomputes).
- kda gate_norm (docs): the first case's kda rows with kernels.kda_gate_norm=moontrain (fla's stages between
  moontrain's gate-and-norm kernels, moontrain.model.kda.chunk).
- kda intra_norm (docs): the same with kernels.kda_intra=moontrain (the intra-chunk stage and the norms' backward
  in one kernel, moontrain.model.kda.intra_norm_kernel; with --dqkg moontrain its dq, dk come in bf16).
- kda walk (docs): the same with the forward's state walk and output as one kernel (moontrain.model.kda.walk_kernel)
  instead of fla's two: the model's default route.
- kda torch: the pure-PyTorch specification, at the first case only (it is the reference, not a kernel).
Median of --iters timed by CUDA events after --warmup (ms: the host waits for each call, so its launch gaps
count), and the device's time alone (dev ms: the host run ahead, as in a training step's queue; fla's KDA is
~25 launches from Python, attention one or a few); model TFLOP/s (at ms) from moontrain.metrics.flops'
per-token counts (KDA: the chunked recurrence; attention: causal scores and values). Each row printed as it
is measured (a time limit keeps the rows done); JSON to --out at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.documents import compiled_flex_attention, flex_block_mask
from moontrain.model.kda.ops import CHUNK, kda, kda_fla, random_kda_inputs

DQK, DV, K = 192, 128, 128


def kda_case(B: int, T: int, H: int, doc_len: int | None, torch_spec: bool, iters: int, warmup: int,
             recompute: bool = False, gate_norm: bool = False, intra_norm: bool = False, walk: bool = False) -> dict:
    leaves, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=doc_len)
    fn = kda if torch_spec else functools.partial(kda_fla, recompute=recompute, gate_norm=gate_norm or intra_norm,
                                                  intra_norm=intra_norm, walk=walk)

    def run() -> tuple[torch.Tensor, ...]:
        o = fn(*leaves, **kwargs)
        return (o, *torch.autograd.grad(o, leaves, go))

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = median_ms(run, iters, warmup)
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2 ** 30  # what a forward+backward adds
    device_ms = None if torch_spec else median_ms(run, iters, 1, host_ahead_ms=40.0)
    flops = 3 * B * T * H * (CHUNK * 5 * K + 6 * K * K)  # moontrain.metrics.flops.kda_mixing_flops_per_token
    name = ("kda torch" if torch_spec else "kda recompute" if recompute else "kda walk" if intra_norm and walk
            else "kda intra_norm" if intra_norm else "kda gate_norm" if gate_norm else "kda")
    return {"case": name + (" docs" if doc_len else ""), "B": B, "T": T, "H": H, "ms": ms, "device_ms": device_ms,
            "tflops": flops / ms / 1e9, "peak_gib": peak_gib}


def attention_case(B: int, T: int, H: int, doc_len: int | None, iters: int, warmup: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k = (torch.randn(B, H, T, DQK, generator=gen, **bf) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=gen, **bf)
    go = torch.randn(B, H, T, DV, generator=gen, **bf)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    block_mask = None
    if doc_len is not None:
        id_BT = (torch.arange(T, device="cuda") // doc_len).expand(B, T).contiguous()
        block_mask = flex_block_mask(id_BT)
    flex = compiled_flex_attention()

    def run() -> tuple[torch.Tensor, ...]:
        if block_mask is None:
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=DQK ** -0.5)
        else:
            o = flex(*leaves, block_mask=block_mask, scale=DQK ** -0.5)
        return (o, *torch.autograd.grad(o, leaves, go))

    ms = median_ms(run, iters, warmup)
    device_ms = median_ms(run, iters, 1, host_ahead_ms=40.0)
    visible = T / 2 if doc_len is None else doc_len / 2  # mean keys per query (causal)
    flops = 6 * B * T * H * (DQK + DV) * visible
    return {"case": "sdpa" if doc_len is None else "flex docs", "B": B, "T": T, "H": H, "ms": ms,
            "device_ms": device_ms, "tflops": flops / ms / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="4x4096x16,2x8192x16,1x32768x16", help="comma-separated BxTxH")
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dqkg", choices=("moontrain", "fla"), default="moontrain",
                   help="the kernel of fla's dqkg backward stage (kernels.kda_dqkg; default: the model's)")
    p.add_argument("--intra", choices=("fla_k64", "fla"), default="fla_k64",
                   help="the kernel of fla's intra-chunk backward stage (kernels.kda_intra; default: the model's)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_kda_<date>.json)")
    args = p.parse_args()
    from moontrain.model.kda.fla_backend import route_fla_stages

    route_fla_stages(dqkg=args.dqkg, intra=args.intra)
    print(f"dqkg stage: {args.dqkg}, intra stage: {args.intra}")
    print(f"{'case':<18} {'B':>3} {'T':>6} {'H':>4} {'ms':>9} {'dev ms':>8} {'TFLOP/s':>9} {'+GiB':>6}", flush=True)
    rows = []
    for i, case in enumerate(args.cases.split(",")):
        B, T, H = (int(x) for x in case.split("x"))
        it = (args.iters, args.warmup)
        kda, attn = functools.partial(kda_case, B, T, H), functools.partial(attention_case, B, T, H)
        runs = [functools.partial(kda, None, False, *it), functools.partial(kda, args.doc_len, False, *it),
                functools.partial(attn, None, *it), functools.partial(attn, args.doc_len, *it)]
        if i == 0:
            runs += [functools.partial(kda, None, False, *it, recompute=True),
                     functools.partial(kda, args.doc_len, False, *it, recompute=True),
                     functools.partial(kda, None, False, *it, gate_norm=True),
                     functools.partial(kda, args.doc_len, False, *it, gate_norm=True),
                     functools.partial(kda, None, False, *it, intra_norm=True),
                     functools.partial(kda, args.doc_len, False, *it, intra_norm=True),
                     functools.partial(kda, None, False, *it, intra_norm=True, walk=True),
                     functools.partial(kda, args.doc_len, False, *it, intra_norm=True, walk=True),
                     functools.partial(kda, None, True, max(3, args.iters // 5), 1)]
        for run in runs:  # each row printed as it is measured, so a time limit keeps the rows done
            r = run()
            rows.append(r)
            gib = f"{r['peak_gib']:>6.2f}" if "peak_gib" in r else f"{'':>6}"
            dev = f"{r['device_ms']:>8.3f}" if r.get("device_ms") is not None else f"{'':>8}"
            print(f"{r['case']:<18} {r['B']:>3} {r['T']:>6} {r['H']:>4} {r['ms']:>9.3f} {dev} {r['tflops']:>9.1f} "
                  f"{gib}", flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / f"bench_kda_{time.strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "doc_len": args.doc_len, "dqkg": args.dqkg, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
