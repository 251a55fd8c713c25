"""The optimizer's pass over parallel.dense=plain's masters on one GPU: torch's fused AdamW followed by the next
forward's foreach cast into the bf16 compute copies (optim.write_back_dense=false), against the write-back
kernel's one launch that steps them and writes the copies (moontrain.optim.write_back_kernel, the default).

    python benchmarks/bench_write_back.py [--recipe recipes/k3_small.yaml] [--iters 10] [--warmup 3] [--out FILE]
        [--tiles 2048x4 4096x8 ...] [--experts] [--bf16-moments]

Shapes: the recipe model's non-expert parameters (k3_small: 397 tensors, 1.29 G elements), built on the meta
device; values random (AdamW's time does not depend on them); a clip factor and a skip flag as the trainer
passes them. Per variant: the median GPU time of the call (CUDA events, benchmarks.timing; the host's launch
work inside it), the device's time alone (the same with the host run ahead, as in a GPU-bound step), the median
host time of the call alone (its launches, no wait), the HBM bytes it must move (torch: p, g, m, v read, p, m, v
and the unscaled g written, then p read and the bf16 copy written: 38 B a parameter; write-back: 30 B) and the
rate they imply at the device's time. Check: one step of each from the same state; p within 64 fp32 ulps of
max |p| (the kernel contracts to FMA, as tests/moontrain/optim/write_back_cases.py bounds it), the bf16 copies
equal where p is. Table printed; JSON to --out. --tiles: the write-back timed at each (elements a program) x
(warps) tile (moontrain.optim.write_back_kernel.TILE, one per moment dtype; default: the shipped ones).
--experts: the same rows at the recipe's expert masters too ([E, ., .] per MoE layer; timed only, the check
runs on the dense set). --bf16-moments:
the write-back with bf16 moments too (optim.state_dtype=bfloat16: 22 B a parameter; tests/moontrain/optim/
write_back_cases.py checks its values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.model.transformer import K3Model
from moontrain.optim import write_back_kernel
from moontrain.optim.write_back_kernel import adamw_write_back_

HPARAMS = dict(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)


def master_shapes(recipe: str, experts: bool) -> list[torch.Size]:
    """The recipe model's dense masters' shapes (experts: its expert masters' instead)."""
    cfg = from_dict(RunConfig, load_recipe(recipe))
    with torch.device("meta"):
        model = K3Model(cfg.model)
    return [p.shape for name, p in model.named_parameters() if (".experts.master." in name) == experts]


class State:
    """Masters, grads, moments, step counts and bf16 copies of the given shapes on the GPU."""

    def __init__(self, shapes: list[torch.Size], seed: int = 0, moments: torch.dtype = torch.float32) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.p = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
        self.g = [torch.randn(s, device="cuda", generator=gen) * 1e-3 for s in shapes]
        self.m = [(torch.randn(s, device="cuda", generator=gen).abs_() * 1e-4).to(moments) for s in shapes]
        self.v = [(torch.randn(s, device="cuda", generator=gen).square_() * 1e-8).to(moments) for s in shapes]
        self.steps = [torch.full((), 10.0, device="cuda") for _ in shapes]
        self.copies = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
        self.scale = torch.tensor(1.25, device="cuda")  # the clip factor
        self.skip = torch.tensor(0.0, device="cuda")  # the device verdict: applied


def torch_step(s: State) -> None:
    """What torch.optim.AdamW(fused=True).step does with a clip factor and a skip flag (the step counts
    advanced around the kernel, a skipped step taken back), then the next forward's cast."""
    torch._foreach_add_(s.steps, 1.0)
    torch._fused_adamw_(s.p, s.g, s.m, s.v, [], s.steps, amsgrad=False, maximize=False, grad_scale=s.scale,
                        found_inf=s.skip, **HPARAMS)
    torch._foreach_sub_(s.steps, [s.skip] * len(s.steps))
    torch._foreach_copy_(s.copies, s.p)  # moontrain.parallel.plain_dense.PlainDense.unshard


def write_back_step(s: State) -> None:
    adamw_write_back_(s.p, s.g, s.m, s.v, s.steps, s.copies, grad_scale=s.scale, found_inf=s.skip,
                      zero_grads=False, **HPARAMS)


def _named(tile: tuple[int, int]) -> str:
    return "x".join(map(str, tile))


def host_ms(fn, state: State, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(state)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/k3_small.yaml")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON path (default: none)")
    p.add_argument("--tiles", nargs="*", default=None, help="write-back tiles ELEMENTSxWARPS (default: the shipped one)")
    p.add_argument("--experts", action="store_true", help="also time the recipe's expert masters")
    p.add_argument("--bf16-moments", action="store_true",
                   help="also time the write-back with bf16 moments (optim.state_dtype=bfloat16)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_write_back needs a CUDA GPU")
    shipped = dict(write_back_kernel.TILE)
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles] if args.tiles else [None]
    shapes = master_shapes(args.recipe, experts=False)
    n = sum(s.numel() for s in shapes)
    a, b = State(shapes), State(shapes)
    torch_step(a)
    write_back_step(b)
    scale = max(float(x.abs().max()) for x in a.p)
    p_diff = max(float((x - y).abs().max()) for x, y in zip(a.p, b.p, strict=True)) / scale
    copies_equal = all(torch.equal(x.to(torch.bfloat16), c) for x, c in zip(b.p, b.copies, strict=True))
    if p_diff > 64 * 2.0**-24 or not copies_equal:
        raise SystemExit(f"write-back differs from torch's step: p by {p_diff:.3g} of max |p|, "
                         f"copies equal to the cast: {copies_equal}")
    del a, b
    rows = []
    sets = [("dense", shapes)] + ([("experts", master_shapes(args.recipe, experts=True))] if args.experts else [])
    for set_name, set_shapes in sets:
        n_set = sum(s.numel() for s in set_shapes)
        variants = [("torch fused AdamW + cast", torch_step, 38, None, torch.float32)]
        variants += [(f"write-back {_named(t or shipped[torch.float32])}", write_back_step, 30, t, torch.float32)
                     for t in tiles]
        if args.bf16_moments:  # optim.state_dtype=bfloat16: m and v read and written as bf16
            variants += [(f"write-back bf16 m, v {_named(t or shipped[torch.bfloat16])}", write_back_step, 22, t,
                          torch.bfloat16) for t in tiles]
        state = None
        for name, fn, bytes_per, tile, moments in variants:
            if state is None or state.m[0].dtype != moments:
                del state  # one set of tensors at a time: the expert masters' take ~50 GB
                state = State(set_shapes, seed=1, moments=moments)
            write_back_kernel.TILE = {**shipped, moments: tile} if tile else shipped
            ms = median_ms(lambda fn=fn, state=state: fn(state), args.iters, args.warmup)
            device_ms = median_ms(lambda fn=fn, state=state: fn(state), args.iters, 1, host_ahead_ms=20.0)
            rows.append({"set": set_name, "variant": name, "tile": tile, "gpu_ms": ms, "device_ms": device_ms,
                         "host_ms": host_ms(fn, state, args.iters), "params": n_set, "bytes": bytes_per * n_set,
                         "tb_per_s": bytes_per * n_set / device_ms / 1e9})
            print(f"  {set_name} {name}: {ms:.3f} ms, device alone {device_ms:.3f} ms", flush=True)
        write_back_kernel.TILE = shipped
        del state
    print(f"{args.recipe}: {len(shapes)} dense tensors, {n / 1e9:.3f} G parameters; {torch.cuda.get_device_name()}; "
          f"median of {args.iters}; write-back p within {p_diff:.2g} of max |p|, copies bitwise the cast; "
          f"shipped tile {shipped[0]}x{shipped[1]}")
    print(f"{'set':8s} {'variant':26s} {'GPU ms':>8s} {'device ms':>9s} {'host ms':>8s} {'GB':>7s} {'TB/s':>6s}")
    for r in rows:
        print(f"{r['set']:8s} {r['variant']:26s} {r['gpu_ms']:8.3f} {r['device_ms']:9.3f} {r['host_ms']:8.3f} "
              f"{r['bytes'] / 1e9:7.2f} {r['tb_per_s']:6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"recipe": args.recipe, "tensors": len(shapes), "params": n,
                                              "p_rel_diff": p_diff, "shipped_tile": shipped, "rows": rows}, indent=1))

if __name__ == "__main__":
    main()
