"""fla's KDA kernels' tiles re-timed at the training shape: every autotuned Triton kernel that chunk_kda's forward
and backward launch, searched over fla's own configurations plus wider ones (8 warps, which fla leaves out on
Hopper for some kernels; larger K and V blocks), at B x T x H heads of 128 (default k3_small's pass: 4 x 4096 x
16), without and with packed documents (device-listed chunks, as moontrain calls fla).

    python benchmarks/bench_fla_tiles.py [--cases 4x4096x16] [--doc-len 1024] [--iters 20] [--warmup 3]
        [--entries DIR] [--out bench_fla_tiles.json]

Why: fla's autotune key leaves out B and T, so each kernel keeps the tile it timed at the first shape it met;
the shipped entries (recipes/data/fla_autotune_h200) were timed at whatever shape came first.

The kernels searched: SWEPT (those of >= 75 us a call in k3_small's profile but the stage kernels.kda_dqkg
replaces) or --kernels. Per kernel and key: the tile the seeded cache picks (shipped), the best of fla's list and the best of all, each
timed here by Triton's autotuner (median of its repeats). Then chunk_kda's forward + backward end to end
(median of --iters CUDA-event timings) with the shipped tiles and with the best ones, and the largest
difference of the output and the input grads between the two (a tile changes summation orders only).
--entries DIR writes, per kernel and key, the autotune file Triton reads (<key folder>/<kernel>.autotune.json,
for fla's own configuration list, all timings measured here): copied into the shipped folder they make every
run pick the best tile. GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import median_ms
from moontrain.model.kda.ops import kda_fla, random_kda_inputs

MODULES = ("fla.ops.kda.chunk_bwd", "fla.ops.kda.chunk_intra", "fla.ops.kda.wy_fast", "fla.ops.kda.gate",
           "fla.ops.common.chunk_delta_h", "fla.ops.gla.chunk", "fla.modules.norm.l2norm", "fla.ops.utils.cumsum",
           "fla.ops.kda.chunk_fwd")
HEAD_DIM = 128
# the kernels of >= 75 us per call in k3_small's profile (docs/performance.md), less fla's WY / inter-chunk
# backward stage, which training runs on moontrain's kernels (kernels.kda_dqkg; --kernels
# chunk_kda_bwd_kernel_wy_dqkg_fused still searches it)
SWEPT = ("chunk_kda_bwd_kernel_intra", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
         "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", "recompute_w_u_fwd_kda_kernel",
         "chunk_kda_fwd_kernel_intra_sub_chunk", "chunk_kda_fwd_kernel_inter_solve_fused", "chunk_gla_fwd_kernel_o",
         "chunk_kda_bwd_kernel_dAv")


def extra_configs(name: str) -> list:
    """The configurations tried beyond fla's list, per kernel (fla's own kwargs names)."""
    import triton

    def grid(kwargs_list: list[dict], warps: tuple[int, ...], stages: tuple[int, ...]) -> list:
        return [triton.Config(kw, num_warps=w, num_stages=s) for kw in kwargs_list for w in warps for s in stages]

    if name == "chunk_kda_bwd_kernel_wy_dqkg_fused":  # BK 32 with 4 warps faults on Hopper (fla leaves it out too)
        return grid([{"BK": bk, "BV": bv} for bk in (64, 128) for bv in (32, 64, 128)], (4, 8), (2, 3))
    if name in ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"):
        return grid([{"BV": bv} for bv in (16, 32, 64)], (4, 8), (2, 3))
    if name == "chunk_kda_fwd_kernel_inter_solve_fused":
        return [triton.Config({"BK": bk}, num_warps=w, num_stages=s) for bk in (32, 64, 128) for w in (2, 4, 8)
                for s in (2, 3)]
    if name == "chunk_gla_fwd_kernel_o":
        return grid([{"BK": bk, "BV": bv} for bk in (64, 128) for bv in (64, 128)], (4, 8), (2, 3))
    if name in ("chunk_kda_bwd_kernel_intra", "recompute_w_u_fwd_kda_kernel", "chunk_kda_fwd_kernel_intra_sub_chunk",
                "chunk_kda_bwd_kernel_dAv"):
        return grid([{}], (2, 4, 8), (1, 2, 3))
    return []


def autotuners(names: tuple[str, ...] | None = None) -> dict[str, object]:
    """fla's autotuned kernels that chunk_kda may launch, by kernel name (only `names` if given)."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for module in MODULES:
        for obj in vars(importlib.import_module(module)).values():
            while not isinstance(obj, Autotuner) and hasattr(obj, "fn"):  # under triton.heuristics
                obj = obj.fn
            if isinstance(obj, Autotuner) and (names is None or obj.base_fn.__name__ in names):
                found[obj.base_fn.__name__] = obj
    return found


def fwd_bwd(leaves: list[torch.Tensor], kwargs: dict, go: torch.Tensor) -> tuple[torch.Tensor, ...]:
    o = kda_fla(*leaves, **kwargs)
    return (o, *torch.autograd.grad(o, leaves, go))


@contextlib.contextmanager
def recording(tuner):
    """The timings of every search `tuner` runs inside the block, in order (Triton keeps only the last in
    configs_timings): its class is swapped for a subclass that records each assignment."""
    searches: list[dict] = []

    class Recording(type(tuner)):
        def __setattr__(self, name, value):
            if name == "configs_timings" and value is not None:
                searches.append(dict(value))
            super().__setattr__(name, value)

    cls = tuner.__class__
    tuner.__class__ = Recording
    try:
        yield searches
    finally:
        tuner.__class__ = cls


def config_row(config, timing) -> dict:
    t = timing[0] if isinstance(timing, list) else timing
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "ms": None if t == float("inf") else round(float(t), 4)}


def sweep_case(B: int, T: int, H: int, doc_len: int | None, iters: int, warmup: int, entries: Path | None,
               names: tuple[str, ...], on_row: Callable[[dict], None]) -> dict:
    """One shape: the shipped tiles' end-to-end time, then one search per kernel (the others keep their shipped
    tile; each finished kernel goes to on_row at once, so a time limit loses only the kernel being searched),
    then the end-to-end time with every kernel's best tile."""
    tuners = autotuners(names)
    missing = set(names) - set(tuners)
    if missing:
        raise SystemExit(f"--kernels {sorted(missing)}: not autotuned kernels of fla's chunk_kda (known: {sorted(tuners)})")
    leaves, kwargs, go = random_kda_inputs(B, T, H, HEAD_DIM, doc_len=doc_len)
    for tuner in tuners.values():  # the tiles a training run uses: the seeded (shipped) entries
        tuner.cache.clear()
    shipped_out = fwd_bwd(leaves, kwargs, go)
    torch.cuda.synchronize()
    shipped = {name: dict(t.cache) for name, t in tuners.items() if t.cache}
    shipped_ms = median_ms(lambda: fwd_bwd(leaves, kwargs, go), iters, warmup)
    print(f"\n{B}x{T}x{H}{f', documents every {doc_len}' if doc_len else ''}: chunk_kda fwd + bwd {shipped_ms:.3f} "
          f"ms with the shipped tiles", flush=True)
    print_header()
    rows, best = [], {}  # best: kernel -> {key: config}
    for name in (n for n in names if n in shipped):
        tuner = tuners[name]
        own, cache_results = list(tuner.configs), tuner.cache_results
        tuner.configs = own + [c for c in extra_configs(name) if str(c) not in {str(o) for o in own}]
        tuner.cache.clear()
        tuner.cache_results = False
        print(f"  ({name}: searching {len(tuner.configs)} tiles)", flush=True)
        with recording(tuner) as searches:
            fwd_bwd(leaves, kwargs, go)  # only this kernel searches, once per key it meets
            torch.cuda.synchronize()
        keys = list(tuner.cache)  # in the order searched, as `searches`
        tuner.configs, tuner.cache_results = own, cache_results
        tuner.cache.clear()
        tuner.cache.update(shipped[name])  # the shipped tiles again while the next kernels search
        for key, timings in zip(keys, searches, strict=True):
            ms = {c: (t[0] if isinstance(t, list) else t) for c, t in timings.items()}
            was = shipped[name].get(key)  # None: a key the shipped run did not meet
            top = min(ms, key=ms.get)
            top_own = min((c for c in ms if str(c) in {str(o) for o in own}), key=ms.get)
            best.setdefault(name, {})[key] = top
            shipped_t = next((ms[c] for c in ms if str(c) == str(was)), float("inf"))
            row = {"kernel": name, "key": [str(x) for x in key], "configs": len(ms),
                   "shipped": None if was is None else config_row(was, shipped_t), "best_fla_list": config_row(top_own, ms[top_own]),
                   "best": config_row(top, ms[top]), "all": [config_row(c, t) for c, t in timings.items()]}
            rows.append(row)
            print_row(row)
            on_row(row)
            if entries is not None:
                write_entry(tuner, key, own, timings, entries)
    for name, chosen in best.items():  # the best tiles, fixed per key
        tuners[name].cache.clear()
        tuners[name].cache.update(chosen)
    tuned_out = fwd_bwd(leaves, kwargs, go)
    tuned_ms = median_ms(lambda: fwd_bwd(leaves, kwargs, go), iters, warmup)
    diffs = {n: (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
             for n, a, b in zip(("o", "dq", "dk", "dv", "df", "dbeta"), tuned_out, shipped_out, strict=True)}
    for tuner in tuners.values():  # searched afresh (from the seeded files) by the next case
        tuner.cache.clear()
    print(f"  chunk_kda fwd + bwd: {shipped_ms:.3f} ms (shipped tiles) -> {tuned_ms:.3f} ms (best tiles); max rel "
          "diff " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()), flush=True)
    return {"case": f"{B}x{T}x{H}", "doc_len": doc_len, "kernels": rows, "shipped_ms": round(shipped_ms, 4),
            "tuned_ms": round(tuned_ms, 4), "max_rel_diff_tuned_vs_shipped": diffs}


def write_entry(tuner, key: tuple, fla_configs: list, timings: dict, entries: Path) -> None:
    """The autotune file Triton's check_disk_cache reads for (kernel, key, fla's configuration list), holding
    the timings measured here (of fla's configurations and the extra ones): Triton picks the fastest."""
    from triton import knobs

    previous = knobs.cache.dir
    knobs.cache.dir = str(entries)
    try:
        tuner.configs_timings = timings
        tuner.check_disk_cache(key, fla_configs, lambda: None)  # no file there yet: writes configs_timings
    finally:
        knobs.cache.dir = previous


def print_header() -> None:
    print(f"  {'kernel':48s} {'n':>3s} {'shipped ms':>10s} {'fla best':>9s} {'best':>8s}  best tile", flush=True)


def print_row(r: dict) -> None:
    def fmt(c: dict) -> str:
        return "-" if c["ms"] is None else f"{c['ms']:.4f}"

    b, was = r["best"], r["shipped"] or {"ms": None}
    print(f"  {r['kernel']:48s} {r['configs']:3d} {fmt(was):>10s} {fmt(r['best_fla_list']):>9s} "
          f"{fmt(b):>8s}  {b['kwargs']} w{b['num_warps']} s{b['num_stages']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["4x4096x16"], help="B x T x H (heads of 128)")
    p.add_argument("--doc-len", type=int, default=1024, help="documents case: a start every this many tokens "
                   "(0: no documents case)")
    p.add_argument("--kernels", nargs="+", default=list(SWEPT), help="the kernels searched (the others keep "
                   "the shipped tiles)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--entries", type=Path, default=None, help="folder for the autotune files (empty or new)")
    p.add_argument("--out", type=str, default=None, help="JSON path (none: the table only)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fla_tiles needs a CUDA GPU")
    if args.entries is not None and args.entries.exists() and any(args.entries.iterdir()):
        raise SystemExit(f"--entries {args.entries} is not empty: give a new folder (entries are never replaced)")
    results, partial = [], []

    def save(row: dict | None = None) -> None:  # after every kernel: a time limit keeps what finished
        if row is not None:
            partial.append(row)
        if args.out:
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "results": results, "searching": partial}, indent=1))

    for case in args.cases:
        B, T, H = (int(x) for x in case.split("x"))
        for doc_len in [None] + ([args.doc_len] if args.doc_len else []):
            results.append(sweep_case(B, T, H, doc_len, args.iters, args.warmup, args.entries, tuple(args.kernels),
                                      save))
            partial.clear()
            save()
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
