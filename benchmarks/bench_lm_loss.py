"""The LM head and the loss, forward + backward: the unfused head (nn.Linear's [N, V] logits, F.cross_entropy
over them in fp32, as the training forward computed them before) against moontrain.model.lm_loss's
linear_cross_entropy (head and CE fused over chunks of tokens), eager and with the chunk math compiled.

    python benchmarks/bench_lm_loss.py [--iters 10] [--warmup 3] [--chunk-mib 256 1024 2048] [--out x.json]
    python benchmarks/bench_lm_loss.py --chunk-math-only --cases 16384x2048x163840   # the per-chunk math alone

GPU cases, bf16: (N, D, V) = (16384, 2048, 163840) (k3_small's vocab at 16k tokens per pass) and
(32768, 2048, 32768) (the DeepSeek-V3 benchmark point: 32k tokens per pass), --cases to change them. On the
CPU (no GPU) one small case, (1024, 256, 8192) in bf16 with chunks of 1 and 4 MiB, timed by the host clock
(no memory column).
Rows per case: unfused eager, unfused with the CE compiled (parallelize's old compile step: the head's GEMM
eager, the loss through torch.compile), fused eager, fused compiled and (GPU) fused with the Triton chunk math
(kernels.lm_loss) at each --chunk-mib (the fp32 logits a chunk may take; the library's defaults are
lm_loss.LOGITS_BYTES_PER_CHUNK and, for the Triton math, TRITON_LOGITS_BYTES_PER_CHUNK); on the GPU two more: the
per-chunk math alone at the PyTorch math's chunk, compiled
and Triton, with the HBM rate of its least traffic (the grad-h column there: the gradients' difference), and
backward's scale of the saved gradients, PyTorch's passes and the Triton pass (the grad-h column: elements whose
bits differ). Columns: median ms of
--iters calls (CUDA events) after --warmup; peak GiB allocated during a call above what was allocated before
it (inputs, and the grads of the previous call freed); loss and the grads' max relative difference from the
unfused eager row (relative to each grad's largest element). Table printed; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.lm_loss import (
    EAGER,
    LOGITS_BYTES_PER_CHUNK,
    TRITON_LOGITS_BYTES_PER_CHUNK,
    chunk_tokens,
    compiled_math,
    linear_cross_entropy,
    triton_math,
)

GPU_CASES = "16384x2048x163840,32768x2048x32768"
CPU_CASE = "1024x256x8192"


def unfused_ce(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """The loss as the training forward computed it before the fusion (moontrain.model.transformer)."""
    return F.cross_entropy(logits_NV.float(), targets_N)


def _host_median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(N: int, D: int, V: int, chunk_mib: list[int], iters: int, warmup: int, device: torch.device) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    h = (torch.randn(N, D, generator=gen, device=device)).to(**bf).requires_grad_()
    w = (torch.randn(V, D, generator=gen, device=device) * D ** -0.5).to(**bf).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen, device=device)
    compiled_ce = torch.compile(unfused_ce)
    variants: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("unfused eager", lambda: unfused_ce(F.linear(h, w), t)),
        ("unfused compiled", lambda: compiled_ce(F.linear(h, w), t)),
    ]
    compiled = compiled_math()
    for mib in chunk_mib:
        c = chunk_tokens(V, mib << 20)
        variants.append((f"fused eager {mib} MiB ({c} tok)",
                         lambda c=c: linear_cross_entropy(h, w, t, chunk=c, math=EAGER)))
        variants.append((f"fused compiled {mib} MiB ({c} tok)",
                         lambda c=c: linear_cross_entropy(h, w, t, chunk=c, math=compiled)))
        if device.type == "cuda":
            variants.append((f"fused triton {mib} MiB ({c} tok)",
                             lambda c=c: linear_cross_entropy(h, w, t, chunk=c, math=triton_math())))
    rows, ref = [], None
    for name, loss_fn in variants:
        def step(loss_fn=loss_fn) -> tuple[torch.Tensor, ...]:
            loss = loss_fn()
            return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

        out = step()  # compiles on first call; the values for the comparison
        if ref is None:
            ref = out
        diff = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(out, ref, strict=True)]
        del out
        peak = None
        if device.type == "cuda":
            ms = median_ms(step, iters, warmup)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        else:
            ms = _host_median_ms(step, iters, warmup)
        rows.append({"N": N, "D": D, "V": V, "variant": name, "ms": ms, "peak_gib": peak, "loss_rel_diff": diff[0],
                     "grad_h_rel_diff": diff[1], "grad_w_rel_diff": diff[2]})
    return rows


def run_chunk_math(N: int, V: int, iters: int, warmup: int) -> list[dict]:
    """The per-chunk math alone (one chunk of the library's size, bf16 logits; the GEMMs left out): the compiled
    specification against the Triton kernels (kernels.lm_loss), with the HBM rate of the least traffic (the
    logits read twice, the gradient written once: 3 c V elements of the logits' size)."""
    c = min(N, chunk_tokens(V))
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(c, V, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (c,), generator=gen, device="cuda")
    rows = []
    for name, math in (("chunk math compiled", compiled_math()), ("chunk math triton", triton_math())):
        work = logits.clone()  # the kernels write the gradient over their input: every call gets fresh logits
        ms = median_ms(lambda math=math, work=work: math.loss_and_grad(work.copy_(logits), t, 1.0 / N), iters, warmup)
        copy_ms = median_ms(lambda work=work: work.copy_(logits), iters, warmup)
        ms -= copy_ms
        rows.append({"N": c, "D": 0, "V": V, "variant": f"{name} ({c} tok)", "ms": ms, "peak_gib": None,
                     "hbm_tb_s": 3 * c * V * logits.element_size() / (ms * 1e-3) / 1e12,
                     "loss_rel_diff": 0.0, "grad_h_rel_diff": 0.0, "grad_w_rel_diff": 0.0})
    loss_ref, grad_ref = compiled_math().loss_and_grad(logits.clone(), t, 1.0 / N)
    loss_k, grad_k = triton_math().loss_and_grad(logits.clone(), t, 1.0 / N)
    rows[-1]["loss_rel_diff"] = ((loss_k - loss_ref).abs() / loss_ref.abs()).item()
    rows[-1]["grad_h_rel_diff"] = ((grad_k.float() - grad_ref.float()).abs().max() / grad_ref.float().abs().max()).item()
    return rows


def run_scale(N: int, D: int, V: int, iters: int, warmup: int) -> list[dict]:
    """Backward's scale of the saved bf16 gradients by the grad of the loss (h's [N, D] and the weight's [V, D],
    a scale of 1/3): lm_loss._scaled's PyTorch passes against the Triton pass (kernels.lm_loss), with the HBM rate
    of the least traffic (each gradient read and written once in bf16); the diff column is 0 when bitwise."""
    from moontrain.model.lm_loss import _scaled

    gen = torch.Generator(device="cuda").manual_seed(2)
    grads = [(torch.randn(n, D, generator=gen, device="cuda") * 1e-4).to(torch.bfloat16) for n in (N, V)]
    scale = torch.tensor(1 / 3, device="cuda")
    rows = []
    for name, math in (("scale pass torch", EAGER), ("scale pass triton", triton_math())):
        ms = median_ms(lambda math=math: [_scaled(g, scale, math) for g in grads], iters, warmup)
        diff = max((_scaled(g, scale, math).view(torch.int16) != _scaled(g, scale).view(torch.int16)).sum().item()
                   for g in grads)
        rows.append({"N": N, "D": D, "V": V, "variant": name, "ms": ms, "peak_gib": None,
                     "hbm_tb_s": sum(4 * g.numel() for g in grads) / (ms * 1e-3) / 1e12,
                     "loss_rel_diff": 0.0, "grad_h_rel_diff": float(diff), "grad_w_rel_diff": 0.0})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=None, help=f"comma-separated NxDxV (GPU default {GPU_CASES}, CPU {CPU_CASE})")
    p.add_argument("--chunk-mib", type=int, nargs="+", default=None,
                   help=f"GPU default 256 {LOGITS_BYTES_PER_CHUNK >> 20} 2048 {TRITON_LOGITS_BYTES_PER_CHUNK >> 20} (the "
                        "library's two among them), CPU 1 4")
    p.add_argument("--chunk-math-only", action="store_true", help="GPU: only the per-chunk math rows (compiled, Triton)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON path (default: none on the CPU, "
                                               "benchmarks/results/bench_lm_loss_<date>.json on a GPU)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = args.cases or (GPU_CASES if device.type == "cuda" else CPU_CASE)
    chunk_mib = args.chunk_mib or ([256, LOGITS_BYTES_PER_CHUNK >> 20, 2048, TRITON_LOGITS_BYTES_PER_CHUNK >> 20]
                                   if device.type == "cuda" else [1, 4])
    rows = []
    for case in cases.split(","):
        N, D, V = (int(x) for x in case.split("x"))
        if not (args.chunk_math_only and device.type == "cuda"):
            rows += run_case(N, D, V, chunk_mib, args.iters, args.warmup, device)
        if device.type == "cuda":
            rows += run_chunk_math(N, V, args.iters, args.warmup)
            rows += run_scale(N, D, V, args.iters, args.warmup)
    print(f"{'N':>6} {'D':>5} {'V':>7}  {'variant':<36} {'ms':>9} {'peak GiB':>9} {'loss diff':>10} "
          f"{'grad_h diff':>11} {'grad_W diff':>11}")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['N']:>6} {r['D']:>5} {r['V']:>7}  {r['variant']:<36} {r['ms']:>9.2f} {peak:>9} "
              f"{r['loss_rel_diff']:>10.2e} {r['grad_h_rel_diff']:>11.2e} {r['grad_w_rel_diff']:>11.2e}"
              + (f" {r['hbm_tb_s']:>6.2f} TB/s" if "hbm_tb_s" in r else ""))
    if args.out or device.type == "cuda":
        out = Path(args.out or Path(__file__).parent / "results" / f"bench_lm_loss_{time.strftime('%Y%m%d')}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                   "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
