"""The fused expert GEMMs against torch._grouped_mm plus the separate passes they replace, on one GPU.

    python benchmarks/bench_expert_gemm.py [--shapes k3_small_moe k3] [--iters 10] [--out DIR]
    python benchmarks/bench_expert_gemm.py --shapes k3_small dsv3_E96 --quack pp128x192 co128x224 co256x128
    python benchmarks/bench_expert_gemm.py --shapes k3_small --merged-only

Shapes per rank (one pass of one MoE layer):
    k3_small_moe   H 2048 (latent = hidden), F 1024, E 192 at EP 2: 96 local groups + 96 slot groups,
                   4096 x 4 sequences x top-8 = 131072 rows, swiglu
    k3             H 3584 (latent), F 3072, E 896 at EP 8: 112 local + 112 slot groups,
                   8192 tokens x top-16 = 131072 rows, situ_glu
    k3_small       the recipe's latent MoE at EP 1: H 1024 (latent), F 896, 64 groups, 16384 tokens x top-8, situ_glu
    dsv3_E96       issue 35's DeepSeek-V3 point at EP 1: H 2048, F 1024, 96 groups, 32768 tokens x top-8, swiglu
The rows go to the local groups (equal sizes, or log-normal with --spread sigma), each padded to 16 as
moonep pads them; the slot groups stay empty (a balanced step: no copies), as in W_compact.

Cases, each timed with CUDA events (median of --iters after --warmup; Triton's autotuning runs first):
  glu forward   torch._grouped_mm gate, up (each), the activation kernel (moonep.kernels.swiglu /
                .situ_glu), their sum; one torch._grouped_mm over gate|up concatenated ([G, H, 2F], what
                a merged projection would allow; no activation); moonep.kernels.grouped_glu saving h and
                u (what training needs), and writing a only.
  wgrad         for gate/up ([G, H, F] from x and grad_h) and down ([G, F, H] from a and grad_o):
                torch._grouped_mm's bf16 wgrad, the masked accumulation into the fp32 grads
                (moonep.kernels.experts.accumulate_groups), their sum; torch._grouped_mm with an fp32
                output plus an fp32 add where this torch supports it; moonep.kernels.grouped_wgrad.
  --quack TILE...: quack's grouped GEMMs (moonep.kernels.quack_gemm, BufferOptions.expert_gemm="quack") at
                each named tile (quack_gemm.gemm_config): the gate GEMM (varlen M), the down GEMM and the
                input gradient through W_gate^T (a transposed view), each beside torch._grouped_mm, and the
                weight gradient added into the fp32 grads in the epilogue, beside the baseline's two passes.
  --merged: gate and up as two [G, H, F] projections against one merged [G, H, 2F] (what one gate|up
                projection in W_full would allow), all on torch._grouped_mm: the forward (two GEMMs of N = F
                against one of 2F), the input gradient (two GEMMs of K = F and the bf16 add the combine
                otherwise fuses, against one of K = 2F), the weight gradient (bf16 out, two against one); each
                merged result against the separate ones (--merged-only: these rows alone).
TFLOP/s counts 2 n I O per GEMM (n rows in groups); a fused or summed row counts the GEMMs it covers.
Each fused result is compared with its baseline (max |diff| relative to max |baseline|). Table printed;
JSON (rows, chosen tile configs, device) written to --out after every shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moonep.grouped_gemm import grouped_mm, grouped_mm_wgrad

SHAPES = {  # name -> (H, F, local groups, slot groups, rows, activation)
    "k3_small_moe": (2048, 1024, 96, 96, 4096 * 4 * 8, "swiglu"),
    "k3": (3584, 3072, 112, 112, 8192 * 16, "situ_glu"),
    "k3_small": (1024, 896, 64, 0, 4096 * 4 * 8, "situ_glu"),
    "dsv3_E96": (2048, 1024, 96, 0, 4096 * 8 * 8, "swiglu"),
}
DEFAULT_SHAPES = ["k3_small_moe", "k3"]
PADDING = 16


def group_offs(local: int, slots: int, rows: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    """int32 cumulative ends: `rows` split over the local groups (padded to PADDING, total <= rows), slots empty."""
    share = torch.ones(local) if spread == 0 else torch.exp(torch.randn(local, generator=gen) * spread)
    sizes = (share / share.sum() * rows / PADDING).floor().long() * PADDING
    sizes = torch.cat([sizes, torch.zeros(slots, dtype=torch.long)])
    return torch.cumsum(sizes, 0).to(torch.int32).cuda()


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def autotuned(kernel, call: Callable[[], object]) -> dict:
    """Run `call` (its first launch of the autotuned `kernel` at a new key tunes it): the chosen config,
    and each config's median ms with the tuning time when this call tuned."""
    before = len(getattr(kernel, "cache", {}))
    call()
    out = {"config": str(getattr(kernel, "best_config", ""))}
    if len(getattr(kernel, "cache", {})) > before and hasattr(kernel, "configs_timings"):
        out["autotune_ms"] = {str(c): (t[0] if isinstance(t, list | tuple) else t)
                              for c, t in kernel.configs_timings.items()}
        out["autotune_s"] = getattr(kernel, "bench_time", None)
    return out


def glu_rows(name: str, H: int, F: int, offs: torch.Tensor, N: int, act: str, args) -> list[dict]:
    from moonep.kernels import grouped_glu
    from moonep.kernels.glu_rows import glu_forward_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    G = offs.numel()
    n = int(offs[-1])
    x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
    wg = (torch.randn(G, H, F, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    wu = (torch.randn(G, H, F, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    w_gate_up = torch.cat([wg, wu], dim=2)  # the heap's gate_up projection [G, H, 2F] (moonep.glu_projections)
    hu = grouped_mm(x, w_gate_up, offs)
    a_base = glu_forward_rows(act, hu)
    tuned = autotuned(grouped_glu._grouped_glu_kernel, lambda: grouped_glu.grouped_glu_forward(x, w_gate_up, offs, act))
    a_fused, hu_fused = grouped_glu.grouped_glu_forward(x, w_gate_up, offs, act)
    diff = {"a": rel_diff(a_fused[:n], a_base[:n]), "hu": rel_diff(hu_fused[:n], hu[:n])}
    gemm = 2 * n * H * F
    t = {
        "torch gate|up GEMM [G, H, 2F]": (median_ms(lambda: grouped_mm(x, w_gate_up, offs), args.iters, args.warmup),
                                          2 * gemm),
        f"{act} on hu's halves": (median_ms(lambda: glu_forward_rows(act, hu), args.iters, args.warmup), 0),
    }
    t["baseline: gate|up + act"] = (sum(ms for ms, _ in t.values()), 2 * gemm)
    t["separate gate, up GEMMs (before the merge)"] = (
        median_ms(lambda: (grouped_mm(x, wg, offs), grouped_mm(x, wu, offs)), args.iters, args.warmup), 2 * gemm)
    t["fused grouped_glu (a, hu)"] = (median_ms(lambda: grouped_glu.grouped_glu_forward(x, w_gate_up, offs, act),
                                                args.iters, args.warmup), 2 * gemm)
    t["fused grouped_glu (a only)"] = (median_ms(
        lambda: grouped_glu.grouped_glu_forward(x, w_gate_up, offs, act, save_preact=False), args.iters, args.warmup),
        2 * gemm)
    base_ms = t["baseline: gate|up + act"][0]
    rows = [{"shape": name, "op": f"glu forward {H}x{F}", "case": case, "ms": ms,
             "tflops": flops / ms / 1e9 if flops else None,
             "speedup_vs_baseline": base_ms / ms if case.startswith("fused") else None}
            for case, (ms, flops) in t.items()]
    rows[-2]["rel_diff_vs_baseline"] = diff
    rows[-2].update(tuned)
    return rows


def wgrad_rows(name: str, I: int, O: int, label: str, offs: torch.Tensor, N: int, g: torch.Tensor,
               args) -> list[dict]:
    from moonep.kernels import grouped_wgrad
    from moonep.kernels.experts import accumulate_groups

    gen = torch.Generator(device="cuda").manual_seed(1)
    G = offs.numel()
    n = int(offs[-1])
    g = g.view(G, I, O)
    x = torch.randn(N, I, device="cuda", generator=gen).to(torch.bfloat16)
    d = torch.randn(N, O, device="cuda", generator=gen).to(torch.bfloat16)
    scale = 0.5

    g.zero_()
    accumulate_groups(g, grouped_mm_wgrad(x, d, offs), offs, scale)
    base = g[: G // 2 + 1].clone()  # the local groups (and one slot) suffice for the comparison
    # tuning restores g between its trials
    tuned = autotuned(grouped_wgrad._grouped_wgrad_kernel, lambda: grouped_wgrad.grouped_wgrad_accumulate(
        g, x, d, offs, scale))
    g.zero_()
    grouped_wgrad.grouped_wgrad_accumulate(g, x, d, offs, scale)
    diff = rel_diff(g[: G // 2 + 1], base)
    del base

    gemm = 2 * n * I * O
    w_bf16 = grouped_mm_wgrad(x, d, offs)
    t = {
        "torch wgrad GEMM (bf16 out)": (median_ms(lambda: grouped_mm_wgrad(x, d, offs), args.iters, args.warmup), gemm),
        "accumulate into fp32 (skips empty)": (median_ms(lambda w=w_bf16: accumulate_groups(g, w, offs, scale),
                                                         args.iters, args.warmup), 0),
    }
    del w_bf16
    t["baseline: wgrad + accumulate"] = (sum(ms for ms, _ in t.values()), gemm)
    try:
        torch._grouped_mm(x.t(), d, offs=offs, out_dtype=torch.float32)

        def fp32_out() -> None:
            g.add_(torch._grouped_mm(x.t(), d, offs=offs, out_dtype=torch.float32), alpha=scale)

        t["torch wgrad GEMM (fp32 out) + add"] = (median_ms(fp32_out, args.iters, args.warmup), gemm)
    except (RuntimeError, TypeError) as e:  # torch versions whose CUDA kernel writes only the input dtype
        print(f"  [{name} {label}] torch._grouped_mm with fp32 out unavailable: {str(e).splitlines()[0][:100]}")
    t["fused grouped_wgrad (beta = 1)"] = (median_ms(
        lambda: grouped_wgrad.grouped_wgrad_accumulate(g, x, d, offs, scale), args.iters, args.warmup), gemm)
    base_ms = t["baseline: wgrad + accumulate"][0]
    rows = [{"shape": name, "op": f"wgrad {label} [G, {I}, {O}]", "case": case, "ms": ms,
             "tflops": flops / ms / 1e9 if flops else None,
             "speedup_vs_baseline": base_ms / ms if case.startswith(("fused", "torch wgrad GEMM (fp32")) else None}
            for case, (ms, flops) in t.items()]
    rows[-1]["rel_diff_vs_baseline"] = diff
    rows[-1].update(tuned)
    return rows


def quack_rows(name: str, H: int, F: int, offs: torch.Tensor, N: int, g: torch.Tensor, args) -> list[dict]:
    """quack's grouped GEMMs at each --quack tile beside torch._grouped_mm: the gate GEMM [n, H] x [G, H, F],
    the down GEMM [n, F] x [G, F, H], the input gradient [n, F] x W_gate^T (a view) and the weight gradient
    into the fp32 grads (scale 0.5, beta = 1) beside torch's bf16 wgrad plus accumulate_groups."""
    from moonep.kernels import quack_gemm
    from moonep.kernels.experts import accumulate_groups

    gen = torch.Generator(device="cuda").manual_seed(2)
    G = offs.numel()
    n = int(offs[-1])
    x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
    a = torch.randn(N, F, device="cuda", generator=gen).to(torch.bfloat16)
    wg = (torch.randn(G, H, F, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    wd = (torch.randn(G, F, H, device="cuda", generator=gen) * F**-0.5).to(torch.bfloat16)
    rows: list[dict] = []
    gemm = 2 * n * H * F
    for op, lhs, w in (("gate GEMM", x, wg), ("down GEMM", a, wd), ("dgrad through W_gate^T", a, wg.transpose(1, 2))):
        want = grouped_mm(lhs, w, offs)
        base_ms = median_ms(lambda lhs=lhs, w=w: grouped_mm(lhs, w, offs), args.iters, args.warmup)
        rows.append({"shape": name, "op": f"quack {op}", "case": "torch._grouped_mm", "ms": base_ms,
                     "tflops": gemm / base_ms / 1e9, "speedup_vs_baseline": None})
        for tile in args.quack:
            began = time.perf_counter()
            got = quack_gemm.grouped_mm(lhs, w, offs, tile=tile)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - began
            ms = median_ms(lambda lhs=lhs, w=w, tile=tile: quack_gemm.grouped_mm(lhs, w, offs, tile=tile),
                           args.iters, args.warmup)
            rows.append({"shape": name, "op": f"quack {op}", "case": f"quack {tile}", "ms": ms,
                         "tflops": gemm / ms / 1e9, "speedup_vs_baseline": base_ms / ms,
                         "rel_diff_vs_baseline": rel_diff(got[:n], want[:n]), "first_call_s": first_s})
    del a, wd, want, got
    g = g.view(G, H, F)
    d = torch.randn(N, F, device="cuda", generator=gen).to(torch.bfloat16)
    scale = 0.5
    g.zero_()
    accumulate_groups(g, grouped_mm_wgrad(x, d, offs), offs, scale)
    base = g.clone()
    base_ms = median_ms(lambda: accumulate_groups(g, grouped_mm_wgrad(x, d, offs), offs, scale), args.iters,
                        args.warmup)
    rows.append({"shape": name, "op": "quack wgrad into fp32", "case": "torch wgrad (bf16) + accumulate", "ms": base_ms,
                 "tflops": gemm / base_ms / 1e9, "speedup_vs_baseline": None})
    for tile in args.quack:
        g.zero_()
        began = time.perf_counter()
        quack_gemm.accumulate_wgrad(g, x, d, offs, scale, 0, tile=tile)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - began
        diff = rel_diff(g, base)
        ms = median_ms(lambda tile=tile: quack_gemm.accumulate_wgrad(g, x, d, offs, scale, 0, tile=tile), args.iters,
                       args.warmup)
        rows.append({"shape": name, "op": "quack wgrad into fp32", "case": f"quack {tile} (beta = 1)", "ms": ms,
                     "tflops": gemm / ms / 1e9, "speedup_vs_baseline": base_ms / ms, "rel_diff_vs_baseline": diff,
                     "first_call_s": first_s})
    return rows


def merged_rows(name: str, H: int, F: int, offs: torch.Tensor, N: int, args) -> list[dict]:
    """--merged: gate and up as separate projections against one merged [G, H, 2F] (module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    G = offs.numel()
    n = int(offs[-1])
    x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
    wg, wu = ((torch.randn(G, H, F, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16) for _ in range(2))
    gh, gu = (torch.randn(N, F, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    w_m, g_m = torch.cat([wg, wu], dim=2), torch.cat([gh, gu], dim=1)
    diff = {
        "forward": rel_diff(grouped_mm(x, w_m, offs)[:n], torch.cat([grouped_mm(x, wg, offs),
                                                                     grouped_mm(x, wu, offs)], dim=1)[:n]),
        "dgrad": rel_diff(grouped_mm(g_m, w_m.transpose(1, 2), offs)[:n],
                          (grouped_mm(gh, wg.transpose(1, 2), offs) + grouped_mm(gu, wu.transpose(1, 2), offs))[:n]),
        "wgrad": rel_diff(grouped_mm_wgrad(x, g_m, offs), torch.cat([grouped_mm_wgrad(x, gh, offs),
                                                                     grouped_mm_wgrad(x, gu, offs)], dim=2)),
    }
    pair = 2 * (2 * n * H * F)
    cases = {
        "forward": (lambda: (grouped_mm(x, wg, offs), grouped_mm(x, wu, offs)), lambda: grouped_mm(x, w_m, offs)),
        "dgrad": (lambda: grouped_mm(gh, wg.transpose(1, 2), offs).add_(grouped_mm(gu, wu.transpose(1, 2), offs)),
                  lambda: grouped_mm(g_m, w_m.transpose(1, 2), offs)),
        "wgrad": (lambda: (grouped_mm_wgrad(x, gh, offs), grouped_mm_wgrad(x, gu, offs)),
                  lambda: grouped_mm_wgrad(x, g_m, offs)),
    }
    rows = []
    for op, (separate, merged) in cases.items():
        sep_ms = median_ms(separate, args.iters, args.warmup)
        mer_ms = median_ms(merged, args.iters, args.warmup)
        label = f"gate|up {op} [G, {H}, {F}]"
        rows.append({"shape": name, "op": label, "case": "separate gate, up" + (" + add" if op == "dgrad" else ""),
                     "ms": sep_ms, "tflops": pair / sep_ms / 1e9, "speedup_vs_baseline": None})
        rows.append({"shape": name, "op": label, "case": "merged [G, H, 2F]", "ms": mer_ms,
                     "tflops": pair / mer_ms / 1e9, "speedup_vs_baseline": sep_ms / mer_ms,
                     "rel_diff_vs_baseline": diff[op]})
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        tf = "" if r["tflops"] is None else f"{r['tflops']:8.1f}"
        diff = r.get("rel_diff_vs_baseline")
        diff = "" if diff is None else (f"{diff:.2e}" if isinstance(diff, float)
                                        else " ".join(f"{k} {v:.2e}" for k, v in diff.items()))
        speedup = "" if r["speedup_vs_baseline"] is None else f"{r['speedup_vs_baseline']:7.2f}"
        print(f"{r['shape']:<13} {r['op']:<26} {r['case']:<38} {r['ms']:8.3f} {tf:>8} {speedup:>7}  {diff}",
              flush=True)
        if r.get("config"):
            print(f"{'':>13} {'':<26} config {r['config']}", flush=True)
        for cfg, ms in r.get("autotune_ms", {}).items():
            print(f"{'':>13} {'':<26}   tried {ms:8.3f} ms  {cfg}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    p.add_argument("--quack", nargs="+", default=[], metavar="TILE",
                   help="add quack's grouped GEMMs at these tiles (e.g. pp128x192 co256x128); needs quack-kernels")
    p.add_argument("--activation", choices=["swiglu", "situ_glu"], default=None,
                   help="instead of each shape's recipe activation")
    p.add_argument("--spread", type=float, default=0.0, help="log-normal sigma of the local groups' sizes")
    p.add_argument("--quack-only", action="store_true", help="with --quack: only its rows (no Triton kernels)")
    p.add_argument("--merged", action="store_true", help="gate and up as two projections against one merged")
    p.add_argument("--merged-only", action="store_true", help="only the --merged rows")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="directory for bench_expert_gemm_<date>.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_gemm needs a CUDA GPU")
    began = time.perf_counter()
    rows: list[dict] = []
    print(f"{'shape':<13} {'op':<26} {'case':<38} {'ms':>8} {'TFLOP/s':>8} {'speedup':>7}  rel diff vs baseline",
          flush=True)
    for name in args.shapes:
        H, F, local, slots, N, act = SHAPES[name]
        act = args.activation or act
        offs = group_offs(local, slots, N, args.spread, torch.Generator().manual_seed(0))
        g = torch.empty(local + slots, H, F, device="cuda")  # the fp32 grad mirror, reused for [G, F, H]
        shape_rows = []
        if args.merged or args.merged_only:
            shape_rows = merged_rows(name, H, F, offs, N, args)
            print_rows(shape_rows)
        if args.quack and not args.merged_only:
            more = quack_rows(name, H, F, offs, N, g, args)
            print_rows(more)
            shape_rows += more
        if not (args.quack_only or args.merged_only):
            more = glu_rows(name, H, F, offs, N, act, args)
            print_rows(more)
            shape_rows += more
            for I, O, label in ((H, F, "gate/up"), (F, H, "down")):
                more = wgrad_rows(name, I, O, label, offs, N, g, args)
                print_rows(more)
                shape_rows += more
        del g
        torch.cuda.empty_cache()
        for r in shape_rows:
            r.update(rows_in_groups=int(offs[-1]), groups=local + slots, activation=act)
        rows += shape_rows
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"bench_expert_gemm_{time.strftime('%Y%m%d')}.json"
            path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "triton": __import__("triton").__version__, "config": vars(args),
                                        "rows": rows}, indent=1))
            print(f"wrote {path}", flush=True)
    print(f"total {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
