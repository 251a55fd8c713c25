"""The router's logits GEMMs (kernels.router_gemm=split_bf16) taken apart on one GPU: each GEMM and helper op of
moontrain.model.router.RouterLogits timed alone, then one forward + backward's CUDA kernels from the profiler.

    python benchmarks/diagnostics/router_gemms.py [--experts 64] [--tokens 16384] [--hidden 2048]

bench_attention.py's router rows time a whole forward + backward from the host (CUDA events around the call,
the host waiting for each), which at these sizes is mostly the host launching ~15 small ops; inside a training
step the host runs ahead and the GPU's kernel time is what the step pays. This script prints both: the
per-op medians (same host-inclusive timing, benchmarks.timing.median_ms) and the profiler's kernel table of
three forward + backward calls, whose total CUDA time / 3 is the kernel time of one. For comparison: the
IEEE fp32 forward on x widened to fp32, the same under TF32, and x.float() (the copy the fp32 routes make).
GPU only (torch.mm's out_dtype is CUDA's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.router import RouterLogits, split_bf16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("router_gemms needs a CUDA GPU")
    s, D, E = args.tokens, args.hidden, args.experts
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(s, D, device="cuda", generator=gen).bfloat16()
    w = torch.randn(E, D, device="cuda", generator=gen) * 0.02
    g = torch.randn(s, E, device="cuda", generator=gen)
    w_hi, w_lo = split_bf16(w)
    g_hi, g_lo = split_bf16(g)
    w2_t = torch.cat([w_hi, w_lo]).t()
    w3, g3 = torch.cat([w_hi, w_lo, w_hi]), torch.cat([g_hi, g_hi, g_lo], 1)
    g2_t = torch.cat([g_hi, g_lo], 1).t()
    cases = {
        "forward: x [s, D] @ [D, 2E], fp32 out": lambda: torch.mm(x, w2_t, out_dtype=torch.float32),
        "grad_x: [s, 3E] @ [3E, D], bf16 out": lambda: torch.mm(g3, w3),
        "grad_w: [2E, s] @ x, fp32 out": lambda: torch.mm(g2_t, x, out_dtype=torch.float32),
        "split_bf16 of the logit grads": lambda: split_bf16(g),
        "cat of grad_x's operand": lambda: torch.cat([g_hi, g_hi, g_lo], 1),
        "x.float() (the fp32 routes' copy)": lambda: x.float(),
        "fp32 forward F.linear(x.float(), w)": lambda: F.linear(x.float(), w),
    }
    print(f"router GEMMs at s {s}, D {D}, E {E} ({torch.cuda.get_device_name()}); median of {args.iters}, "
          "host-inclusive")
    for name, fn in cases.items():
        print(f"  {name:<40} {median_ms(fn, args.iters, args.warmup) * 1000:8.1f} us", flush=True)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        ms = median_ms(lambda: F.linear(x.float(), w), args.iters, args.warmup)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    print(f"  {'the same under TF32':<40} {ms * 1000:8.1f} us")
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    def full() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(RouterLogits.apply(xr, wr), (xr, wr), g)

    print(f"  {'RouterLogits forward + backward':<40} {median_ms(full, args.iters, args.warmup) * 1000:8.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            full()
        torch.cuda.synchronize()
    print("RouterLogits forward + backward x 3, CUDA kernels:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
