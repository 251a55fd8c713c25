"""One profiled training step in the recipe's mode (train.deterministic true or false): step time and the
GPU kernels by CUDA time. benchmarks/check_determinism.py --profile runs it once per mode and compares.

    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/diagnostics/profile_determinism.py \\
        --out FILE.json RECIPE [key=value ...]

A fresh Trainer trains --warmup untimed steps (compiles, autotunes), then --steps timed ones (device
synchronised around each; the median is reported), then one profiled step. Rank 0 prints the kernel
classes of moontrain's profile timeline (benchmarks/diagnostics/train_diagnostics.py) and the --top kernels by total
CUDA time, and writes them as JSON: {"deterministic", "step_time_s", "profiled_step_s", "classes": {class:
us}, "kernels": [{"name", "class", "count", "total_us"}]} (rank 0's kernels). On the CPU (gloo) it runs the
same steps with empty kernel lists: a check of the script, not a profile.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.diagnostics.train_diagnostics import _gpu_kernels, kernel_class
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout
from moontrain.trainer.determinism import set_cublas_workspace
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.worker import select_device


def kernel_totals(kernels: list[tuple[int, int, int, str]]) -> list[dict]:
    """(stream, start, duration ns, name) events -> per name: class, count, total us (largest first)."""
    count: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    for _, _, dur, name in kernels:
        count[name] += 1
        total[name] += dur
    return [{"name": name, "class": kernel_class(name), "count": count[name], "total_us": total[name] / 1e3}
            for name, _ in total.most_common()]


def class_totals(rows: list[dict]) -> dict[str, float]:
    out: collections.Counter = collections.Counter()
    for row in rows:
        out[row["class"]] += row["total_us"]
    return dict(out.most_common())


def print_profile(result: dict, top: int) -> None:
    print(f"train.deterministic={result['deterministic']}: median step {result['step_time_s'] * 1e3:.1f} ms, "
          f"profiled step {result['profiled_step_s'] * 1e3:.1f} ms")
    print(f"{'kernel class':<24}{'CUDA ms':>10}")
    for name, us in result["classes"].items():
        print(f"{name:<24}{us / 1e3:>10.2f}")
    print(f"\n{'CUDA ms':>9}{'calls':>7}  kernel (top {top})")
    for row in result["kernels"][:top]:
        print(f"{row['total_us'] / 1e3:>9.2f}{row['count']:>7}  {row['name'][:110]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (rank 0)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = from_dict(RunConfig, load_recipe(args.recipe, args.overrides))
    if cfg.train.deterministic:
        set_cublas_workspace()
    device, backend = select_device()
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                            device_id=device if cuda else None)
    try:
        trainer = Trainer(cfg, build_layout(cfg.parallel.ep, device))
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            trainer.train_step()
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            trainer.train_step()
            sync()
            profiled = time.perf_counter() - start
        rows = kernel_totals(_gpu_kernels(prof))
        result = {"recipe": args.recipe, "overrides": args.overrides, "deterministic": cfg.train.deterministic,
                  "step_time_s": statistics.median(times) if times else None, "profiled_step_s": profiled,
                  "classes": class_totals(rows), "kernels": rows}
        if dist.get_rank() == 0:
            print_profile(result, args.top)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        trainer.close()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
