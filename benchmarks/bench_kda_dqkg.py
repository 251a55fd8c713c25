"""KDA's chunked backward WY / inter-chunk stage on one GPU: fla-core's chunk_kda_bwd_wy_dqkg_fused against
moontrain.model.kda_dqkg_kernel.kda_dqkg (same arguments, same outputs).

    python benchmarks/bench_kda_dqkg.py [--iters 20] [--warmup 3] [--out bench_kda_dqkg.json]

Shape: B=4, T=4096, H=16, K=V=128, chunk 64, bf16 q/k/v/h/A, fp32 g (random inputs at fla's scales, as
moontrain.model.kda_dqkg.random_stage_inputs builds them), without documents and with packed
documents of 1024 tokens (cu_seqlens over the flattened batch, fla's host-listed chunks). Rows: median ms
of CUDA-event timings per launcher (ours: both kernels, the workspace allocation included; the first call
autotunes and is not timed), TFLOP/s of the stage's matmuls (6CKV + 4C^2 (K + V) + 4C^3 per chunk and
head), GB/s of its compulsory traffic (inputs read once, outputs written once; ours also moves its fp32
partials, not counted), and per output the max |ours - fla| and max |fla|. Then KDA's whole forward + backward
(kda_fla: the numbers bench_kda reports and issue 35's 2.7 ms target) with fla's stage and with the stage
routed here (kernels.kda_dqkg=moontrain). GPU only; needs fla-core.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import moontrain.model.kda_dqkg_kernel as kernel
from benchmarks.timing import kernel_bench_args, median_ms
from moontrain.model.kda_dqkg import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda_dqkg import random_stage_inputs as stage_inputs
from moontrain.model.kda_dqkg_kernel import kda_dqkg

B, T, H, K, V, C = 4, 4096, 16, 128, 128, 64
DOC_LEN = 1024


def inputs(docs: bool) -> dict:
    if not docs:
        return stage_inputs(B, T, H, K, V, torch.bfloat16, "cuda", seed=0)
    from fla.ops.utils import prepare_chunk_indices

    cu_seqlens = torch.arange(0, B * T + 1, DOC_LEN, dtype=torch.int32, device="cuda")
    chunk_indices = prepare_chunk_indices(cu_seqlens, C)
    return stage_inputs(1, B * T, H, K, V, torch.bfloat16, "cuda", seed=0, cu_seqlens=cu_seqlens,
                        chunk_indices=chunk_indices)


def stage_cost(args: dict, outs: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(FLOPs of the stage's matmuls, bytes of its inputs and outputs)."""
    num_chunk_heads = B * T // C * H  # documents of 1024 tokens: whole chunks, the same count
    flops = num_chunk_heads * (6 * C * K * V + 4 * C * C * (K + V) + 4 * C ** 3)
    names = ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")
    nbytes = sum(args[n].numel() * args[n].element_size() for n in names)
    nbytes += sum(x.numel() * x.element_size() for x in outs)
    return flops, nbytes


def bench_case(docs: bool, iters: int, warmup: int) -> list[dict]:
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    args = inputs(docs)
    fla_out = chunk_kda_bwd_wy_dqkg_fused(**args)  # also fla's autotuning
    ours_out = kda_dqkg(**args)  # also ours
    flops, nbytes = stage_cost(args, fla_out)
    rows = []
    for name, fn in (("fla", chunk_kda_bwd_wy_dqkg_fused), ("ours", kda_dqkg)):
        ms = median_ms(lambda fn=fn: fn(**args), iters, warmup)
        row = dict(docs=docs, launcher=name, ms=ms, tflops=flops / ms / 1e9, gb_per_s=nbytes / ms / 1e6)
        if name == "ours":
            row["configs"] = [str(kernel._kblock_tuned.best_config), str(kernel._finish_tuned.best_config)]
            row["max_abs_diff_vs_fla"] = {n: (a.float() - b.float()).abs().max().item()
                                          for n, a, b in zip(OUTPUTS, ours_out, fla_out, strict=True)}
            row["max_abs_fla"] = {n: b.float().abs().max().item() for n, b in zip(OUTPUTS, fla_out, strict=True)}
        rows.append(row)
    for row in rows:
        print(f"docs {docs!s:5} {row['launcher']:4}: {row['ms']:7.3f} ms  {row['tflops']:6.1f} TFLOP/s  "
              f"{row['gb_per_s']:7.0f} GB/s", flush=True)
    print(f"  ours' autotuned tiles: {'; '.join(rows[1]['configs'])}")
    diffs = rows[1]["max_abs_diff_vs_fla"]
    print("  max |ours - fla| (max |fla|): " + ", ".join(
        f"{n} {diffs[n]:.2e} ({rows[1]['max_abs_fla'][n]:.2e})" for n in OUTPUTS), flush=True)
    return rows


def layer_case(docs: bool, iters: int, warmup: int) -> list[dict]:
    """KDA's whole fwd + bwd (kda_fla, fla's chunk_kda with the gate and L2 norm fused) with fla's stage and
    with the stage routed to kda_dqkg (kernels.kda_dqkg), as bench_kda times it."""
    from moontrain.model.kda_ops import kda_fla, random_kda_inputs

    leaves, kwargs, go = random_kda_inputs(B, T, H, K, doc_len=DOC_LEN if docs else None)

    def run() -> None:
        torch.autograd.grad(kda_fla(*leaves, **kwargs), leaves, go)

    rows = []
    for stage in ("fla", "moontrain"):
        kernel.route_fla_stage(stage == "moontrain")
        try:
            rows.append(dict(docs=docs, layer_fwd_bwd=stage, ms=median_ms(run, iters, warmup)))
        finally:
            kernel.route_fla_stage(False)
        print(f"docs {docs!s:5} KDA fwd + bwd, stage on {stage:9}: {rows[-1]['ms']:7.3f} ms", flush=True)
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_kda_dqkg")
    rows = []
    for docs in (False, True):
        rows += bench_case(docs, args.iters, args.warmup)
    for docs in (False, True):
        rows += layer_case(docs, args.iters, args.warmup)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), shape=dict(
            B=B, T=T, H=H, K=K, V=V, chunk=C, doc_len=DOC_LEN), rows=rows), indent=1))


if __name__ == "__main__":
    main()
