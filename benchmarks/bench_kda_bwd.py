"""KDA's chunked backward on one GPU: fla-core's two slowest backward stages against moontrain's launches (same
arguments, same outputs), then KDA's whole forward + backward with each stage on either.

    python benchmarks/bench_kda_bwd.py [--iters 20] [--warmup 3] [--out bench_kda_bwd.json]

Stages:
- dqkg, the WY / inter-chunk stage: fla's chunk_kda_bwd_wy_dqkg_fused against
  moontrain.model.kda.dqkg_kernel.kda_dqkg (kernels.kda_dqkg).
- intra, the intra-chunk stage: fla's chunk_kda_bwd_intra (safe gate, lower bound -5, as the model's KDA calls
  it) against moontrain.model.kda.intra_fla.kda_intra_fla (fla's kernel with 64-wide K-blocks, kernels.kda_intra).
Shape: B=4, T=4096, H=16, K=V=128, chunk 64, bf16 q/k/v/h/A, fp32 g and gradients (random inputs at fla's
scales, as the specifications' random_stage_inputs build them), without documents and with packed documents of
1024 tokens (cu_seqlens over the flattened batch, fla's host-listed chunks). Rows: median ms of CUDA-event
timings per launcher (workspaces included; the first call autotunes and is not timed), TFLOP/s of the stage's
matmuls as fla computes them (dqkg: 6CKV + 4C^2 (K + V) + 4C^3 per chunk and head; intra: 4 products of the
lower [C, C] halves with [C, K], 4C^2 K), GB/s of the compulsory traffic (inputs read once, outputs written
once), and per output the max |ours - fla| and max |fla|. Then KDA's whole forward + backward (kda_fla: the
numbers bench_kda reports, issue 35's 2.7 ms target) with the stages on fla's kernels, dqkg routed here, dqkg
here and intra on fla's kernel with 64-wide K-blocks (the model's defaults). GPU only; needs fla-core.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import kernel_bench_args, median_ms
from moontrain.model.kda import dqkg as kda_dqkg
from moontrain.model.kda import intra as kda_intra
from moontrain.model.kda.fla_backend import route_fla_stages

B, T, H, K, V, C = 4, 4096, 16, 128, 128, 64
DOC_LEN = 1024


def documents() -> dict:
    from fla.ops.utils import prepare_chunk_indices

    cu_seqlens = torch.arange(0, B * T + 1, DOC_LEN, dtype=torch.int32, device="cuda")
    return dict(cu_seqlens=cu_seqlens, chunk_indices=prepare_chunk_indices(cu_seqlens, C))


def stage_setup(stage: str, docs: bool) -> tuple[dict, object, object, tuple[str, ...], float, tuple[str, ...]]:
    """(inputs, fla's launcher, ours, output names, FLOPs, names of the inputs of the compulsory traffic)."""
    shape = dict(B=1, T=B * T, **documents()) if docs else dict(B=B, T=T)
    num_chunk_heads = B * T // C * H  # documents of 1024 tokens: whole chunks, the same count
    if stage == "dqkg":
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

        from moontrain.model.kda.dqkg_kernel import kda_dqkg as ours

        args = kda_dqkg.random_stage_inputs(shape.pop("B"), shape.pop("T"), H, K, V, torch.bfloat16, "cuda", seed=0,
                                            **shape)
        flops = num_chunk_heads * (6 * C * K * V + 4 * C * C * (K + V) + 4 * C ** 3)
        names = ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")
        return args, chunk_kda_bwd_wy_dqkg_fused, ours, kda_dqkg.STAGE_OUTPUTS, flops, names
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    from moontrain.model.kda.intra_fla import kda_intra_fla as ours

    args = kda_intra.random_stage_inputs(shape.pop("B"), shape.pop("T"), H, K, torch.bfloat16, "cuda", seed=0,
                                         **shape)
    args["dAqk"], args["dAkk"] = args["dAqk"].nan_to_num(0.0), args["dAkk"].nan_to_num(0.0)  # fla reads dAkk's diagonal
    flops = num_chunk_heads * 4 * C * C * K
    names = ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg")
    return args, chunk_kda_bwd_intra, ours, kda_intra.STAGE_OUTPUTS, flops, names


def bench_stage(stage: str, docs: bool, iters: int, warmup: int) -> list[dict]:
    args, fla_fn, ours_fn, outputs, flops, names = stage_setup(stage, docs)
    fla_out = [x.clone() for x in fla_fn(**args)]  # also fla's autotuning
    ours_out = ours_fn(**args)  # also ours
    nbytes = sum(args[n].numel() * args[n].element_size() for n in names)
    nbytes += sum(x.numel() * x.element_size() for x in fla_out)
    rows = []
    for name, fn in (("fla", fla_fn), ("ours", ours_fn)):
        ms = median_ms(lambda fn=fn: fn(**args), iters, warmup)
        rows.append(dict(stage=stage, docs=docs, launcher=name, ms=ms, tflops=flops / ms / 1e9,
                         gb_per_s=nbytes / ms / 1e6))
        print(f"{stage:5} docs {docs!s:5} {name:4}: {ms:7.3f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s  "
              f"{rows[-1]['gb_per_s']:7.0f} GB/s", flush=True)
    ours = rows[1]
    ours["configs"] = tuned_configs(stage)
    ours["max_abs_diff_vs_fla"] = {n: (a.float() - b.float()).abs().max().item()
                                   for n, a, b in zip(outputs, ours_out, fla_out, strict=True)}
    ours["max_abs_fla"] = {n: b.float().abs().max().item() for n, b in zip(outputs, fla_out, strict=True)}
    print(f"  ours' autotuned tiles: {'; '.join(ours['configs'])}")
    print("  max |ours - fla| (max |fla|): " + ", ".join(
        f"{n} {ours['max_abs_diff_vs_fla'][n]:.2e} ({ours['max_abs_fla'][n]:.2e})" for n in outputs), flush=True)
    return rows


def tuned_configs(stage: str) -> list[str]:
    if stage == "dqkg":
        from moontrain.model.kda import dqkg_kernel as kernel

        return [str(kernel._kblock_tuned.best_config), str(kernel._finish_tuned.best_config)]
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_kernel_intra  # fla's autotuner, last run by ours (BK 64)

    return [str(chunk_kda_bwd_kernel_intra.best_config)]


def layer_case(docs: bool, iters: int, warmup: int) -> list[dict]:
    """KDA's whole fwd + bwd (kda_fla, fla's chunk_kda with the gate and L2 norm fused) with the two stages on
    fla's kernels, the dqkg stage routed here, and both routed here (the defaults), as bench_kda times it."""
    from moontrain.model.kda.ops import kda_fla, random_kda_inputs

    leaves, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=DOC_LEN if docs else None)

    def run() -> None:
        torch.autograd.grad(kda_fla(*leaves, **kwargs), leaves, go)

    rows = []
    for dqkg, intra in (("fla", "fla"), ("moontrain", "fla"), ("moontrain", "fla_k64")):
        route_fla_stages(dqkg=dqkg, intra=intra)
        try:
            rows.append(dict(docs=docs, layer_fwd_bwd=dict(dqkg=dqkg, intra=intra), ms=median_ms(run, iters, warmup)))
        finally:
            route_fla_stages(dqkg="fla", intra="fla")
        print(f"docs {docs!s:5} KDA fwd + bwd, dqkg {dqkg:9}, intra {intra:9}: {rows[-1]['ms']:7.3f} ms", flush=True)
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_kda_bwd")
    rows = []
    for stage in ("intra", "dqkg"):
        for docs in (False, True):
            rows += bench_stage(stage, docs, args.iters, args.warmup)
    for docs in (False, True):
        rows += layer_case(docs, args.iters, args.warmup)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), shape=dict(
            B=B, T=T, H=H, K=K, V=V, chunk=C, doc_len=DOC_LEN), rows=rows), indent=1))


if __name__ == "__main__":
    main()
