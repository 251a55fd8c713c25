"""Optimizer cost inside a training step: AdamW vs Muon (and QK-Clip), one process.

    python benchmarks/bench_optim.py --recipe recipes/k3_small.yaml parallel.ep=1
    python benchmarks/bench_optim.py --recipe recipes/k3_tiny.yaml parallel.ep=1 --steps 3 --warmup 1   # CPU check
    python benchmarks/bench_optim.py --show benchmarks/results/bench_optim_<tag>.json

Per variant (--variants, default: adamw, muon, muon+qkclip) a fresh Trainer (same seed) in a one-rank
process group, built as `moontrain launch` builds it (FSDP2 with its bf16 compute, the recipe's experts
backend), runs --warmup + --steps optimizer steps through Trainer.train_step. Timed with CUDA events (wall clock on
CPU) around each whole step, around optimizer.step() and around QK-Clip's clip (its max-logit pass runs
inside the forward: it shows in the step time of muon+qkclip against muon). Reported: median step time,
median optimizer time and its share of the step, the clip's time, and the step time against AdamW's.
--profile-steps N records N more steps of each variant with torch.profiler and prints the top kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer

VARIANTS = {"adamw": ("adamw", 0.0), "muon": ("muon", 0.0), "muon+qkclip": ("muon", 100.0)}


class _Timer:
    """Intervals measured with CUDA events (read once at the end) or the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple] = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, begin) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((begin, end))
        else:
            self.pairs.append((begin, time.perf_counter()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [b.elapsed_time(e) / 1e3 for b, e in self.pairs]
        return [e - b for b, e in self.pairs]


def _wrap(obj, attr: str, timer: _Timer) -> None:
    fn = getattr(obj, attr)

    def timed(*args, **kwargs):
        t = timer.start()
        out = fn(*args, **kwargs)
        timer.stop(t)
        return out

    setattr(obj, attr, timed)


def run_variant(name: str, cfg: RunConfig, device: torch.device, args: argparse.Namespace) -> dict:
    began = time.perf_counter()
    trainer = Trainer(cfg, build_layout(cfg.parallel.ep, device))
    print(f"{name}: trainer built in {time.perf_counter() - began:.1f} s", flush=True)
    step_t, opt_t, clip_t = _Timer(device), _Timer(device), _Timer(device)
    _wrap(trainer.optimizer, "step", opt_t)
    if trainer.qk_clip is not None:
        _wrap(trainer.qk_clip, "step", clip_t)
    for i in range(args.warmup + args.steps):
        t = step_t.start()
        trainer.train_step()
        step_t.stop(t)
        print(f"{name}: step {i + 1}/{args.warmup + args.steps} done at {time.perf_counter() - began:.1f} s", flush=True)
    steps, opts, clips = (x.seconds()[args.warmup:] for x in (step_t, opt_t, clip_t))
    out = {"step_s": statistics.median(steps), "optimizer_s": statistics.median(opts),
           "clip_s": statistics.median(clips) if clips else 0.0, "steps_s": steps, "optimizer_steps_s": opts}
    out["optimizer_share"] = out["optimizer_s"] / out["step_s"]
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                trainer.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
    trainer.close()
    return out


def print_table(result: dict) -> None:
    base = result["variants"].get("adamw", {}).get("step_s")
    print(f"{'variant':12} {'step ms':>9} {'optim ms':>9} {'share':>7} {'clip ms':>8} {'vs adamw':>9}")
    for name, r in result["variants"].items():
        rel = f"{r['step_s'] / base:9.3f}" if base else f"{'':>9}"
        print(f"{name:12} {r['step_s'] * 1e3:9.1f} {r['optimizer_s'] * 1e3:9.1f} {r['optimizer_share']:7.1%} "
              f"{r['clip_s'] * 1e3:8.2f} {rel}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/k3_small.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_optim_<recipe>_<dev>.json)")
    p.add_argument("--show", metavar="JSON")
    args = p.parse_args()
    if args.show:
        print_table(json.loads(Path(args.show).read_text()))
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # one rank, as `moontrain launch --nproc 1` runs it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    base = from_dict(RunConfig, load_recipe(args.recipe, [*args.overrides, "metrics.wandb=false",
                                                          "checkpoint.save_final=false", "train.log_every=1000000"]))
    result = {"recipe": args.recipe, "overrides": args.overrides, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "variants": {}}
    for name in args.variants:
        optim_name, tau = VARIANTS[name]
        adamw = optim_name == "adamw"  # Muon keeps fp32 state: the recipe's bf16 AdamW moments apply to AdamW only
        optim = dataclasses.replace(base.optim, name=optim_name, qk_clip_tau=tau, write_back=None if adamw else False,
                                    state_dtype=base.optim.state_dtype if adamw else "float32")
        cfg = dataclasses.replace(base, optim=optim)
        result["variants"][name] = run_variant(name, cfg, device, args)
        print(name, {k: v for k, v in result["variants"][name].items() if not k.endswith("steps_s")}, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    out = Path(args.out or f"benchmarks/results/bench_optim_{Path(args.recipe).stem}_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
