"""MLA attention core on one GPU: SDPA at unequal head dims vs zero-padded to one head dim, SDPA vs the
compiled flex_attention with a causal block mask (train.deterministic's path), and the router's logits
GEMMs in IEEE fp32 vs TF32.

    python benchmarks/bench_attention.py [--batch 4] [--seq 4096]      (one GPU; k3_small_moe shapes)

Attention: forward + backward of F.scaled_dot_product_attention (causal, bf16) as MLAttention calls
it with kernels.attn_pad_head_dims off (q/k 192, v 128) and on (all 192), plus which SDPA backend ran
(from the profiler's kernel names), and whether two runs give the same bits ("repeatable": the
output and every gradient; flex_attention's backward has no atomics, SDPA's usually do). Router: logits = x W^T with its two backward GEMMs, bf16 x and fp32
W as the router takes them: F.linear on x widened to fp32 (kernels.router_gemm=fp32: IEEE fp32 on FFMA), the
same under allow_tf32 (the TF32 route that split_bf16 replaced), and moontrain.model.router.RouterLogits
(split_bf16: bf16 tensor cores, no fp32 copy of x). Median of --iters timed by CUDA events after --warmup; the outputs of each pair are compared
(max abs difference printed). Table printed; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.documents import causal_flex_mask, compiled_flex_attention
from moontrain.model.router import RouterLogits


def kernels_of(fn: Callable[[], object]) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    def tag(name: str) -> str | None:  # cuDNN's kernel names contain "flash" too: test it first
        name = name.lower()
        if "cudnn" in name:
            return "cudnn"
        if "flash" in name:
            return "flash"
        return "mem-efficient" if "fmha" in name or "efficient" in name else None

    return "+".join(sorted({t for t in map(tag, names) if t})) or "math"


def attention_case(B: int, N: int, T: int, dqk: int, dv: int, kind: str, iters: int, warmup: int) -> dict:
    """kind: "padded" / "unpadded" (SDPA, as MLAttention with kernels.attn_pad_head_dims on / off) or "flex"
    (compiled flex_attention with causal_flex_mask, as MLAttention under train.deterministic)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, N, T, dqk, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, N, T, dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    go = torch.randn(B, N, T, dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    block_mask = causal_flex_mask(T, q.device).block_mask if kind == "flex" else None

    def run() -> tuple[torch.Tensor, ...]:
        qq, kk, vv = leaves
        if kind == "flex":
            o = compiled_flex_attention()(qq, kk, vv, block_mask=block_mask, scale=dqk ** -0.5)
        else:
            if kind == "padded":
                d = max(dqk, dv)
                qq, kk, vv = F.pad(qq, (0, d - dqk)), F.pad(kk, (0, d - dqk)), F.pad(vv, (0, d - dv))
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=dqk ** -0.5)[..., :dv]
        grads = torch.autograd.grad(o, leaves, go)
        return (o, *grads)

    ms = median_ms(run, iters, warmup)
    flops = 3 * B * N * T * T * (dqk + dv)  # model FLOPs (forward 2 T^2 (dqk + dv) / 2 causal, x3 with backward)
    first, second = run(), run()
    return {"case": f"attention {kind}", "ms": ms, "backend": "flex" if kind == "flex" else kernels_of(run),
            "tflops": flops / ms / 1e9, "repeatable": all(map(torch.equal, first, second)), "out": first}


def router_case(s: int, D: int, E: int, kind: str, iters: int, warmup: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(s, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(E, D, device="cuda", generator=gen) * 0.02).requires_grad_()
    g = torch.randn(s, E, device="cuda", generator=gen)

    def run() -> tuple[torch.Tensor, ...]:
        y = RouterLogits.apply(x, w) if kind == "split bf16" else F.linear(x.float(), w)
        return (y, *torch.autograd.grad(y, (x, w), g))

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    try:
        ms = median_ms(run, iters, warmup)
        out = run()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return {"case": f"router {kind}", "ms": ms, "backend": "cublas", "tflops": 3 * 2 * s * D * E / ms / 1e9,
            "out": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--qk-head-dim", type=int, default=192)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    B, N, T = args.batch, args.heads, args.seq
    padded, unpadded, flex = (attention_case(B, N, T, args.qk_head_dim, args.v_head_dim, kind, args.iters, args.warmup)
                              for kind in ("padded", "unpadded", "flex"))
    ieee, tf32, split = (router_case(B * T, args.hidden, args.experts, kind, args.iters, args.warmup)
                         for kind in ("fp32", "tf32", "split bf16"))
    # each row against the one before; the router's rows against IEEE fp32
    for base, new in ((padded, unpadded), (unpadded, flex), (ieee, tf32), (ieee, split)):
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(base["out"], new["out"], strict=True))
        new["max_abs_diff_vs_" + base["case"].split()[-1]] = diff
        new["speedup"] = base["ms"] / new["ms"]
    rows = [padded, unpadded, flex, ieee, tf32, split]
    for r in rows:
        r.pop("out")
    print(f"{'case':<22} {'ms':>8} {'TFLOP/s':>8} {'backend':<16} {'speedup':>8} {'repeatable':>10}  max|diff|")
    for r in rows:
        diff = next((v for k, v in r.items() if k.startswith("max_abs_diff")), None)
        print(f"{r['case']:<22} {r['ms']:8.3f} {r['tflops']:8.1f} {r['backend']:<16} "
              f"{r.get('speedup', 1.0):8.2f} {r.get('repeatable', '')!s:>10}  {'' if diff is None else f'{diff:.3g}'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_attention_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "config": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
