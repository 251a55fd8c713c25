"""Muon vs AdamW on a recipe (k3_tiny on CPU): a learning-rate sweep per optimizer, then the steps Muon needs.

    python benchmarks/muon_sweep.py --recipe recipes/k3_tiny.yaml --lrs 1.5e-3 3e-3 6e-3 1.2e-2 2.4e-2
    python benchmarks/muon_sweep.py --show benchmarks/results/muon_sweep_k3_tiny_cpu.json

Every point is a fresh single-process Trainer (experts.backend=local, parallel.ep=1: the model and data of
the recipe, the same seed, so the same initial weights and batches), trained for the recipe's
train.steps with its schedule; only optim.name and optim.lr change. The loss is the trainer's logged
window mean (train.log_every steps). Each optimizer's best lr is the one with the lowest final loss;
"Muon reaches AdamW" is the first logged step at which Muon's (best lr) window loss is at or below
AdamW's (best lr) final window loss, and the ratio is that step over train.steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer


def run_point(recipe: str, overrides: list[str], name: str, lr: float, log_every: int) -> dict:
    extra = [f"optim.name={name}", f"optim.lr={lr}", "experts.backend=local", "parallel.ep=1",
             f"train.log_every={log_every}", "metrics.wandb=false", "checkpoint.save_final=false",
             "checkpoint.every=0", f"train.run_dir=runs/muon_sweep/{name}_{lr:g}"]
    if name == "muon":
        extra.append("optim.state_dtype=float32")  # Muon's state is fp32 (a recipe may set bf16 AdamW moments)
    cfg = from_dict(RunConfig, load_recipe(recipe, [*overrides, *extra]))
    trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
    t0 = time.perf_counter()
    stats = trainer.fit()
    trainer.close()
    return {"optim": name, "lr": lr, "steps": [s.step for s in stats], "loss": [s.loss for s in stats],
            "final_loss": stats[-1].loss, "seconds": time.perf_counter() - t0}


def summarise(points: list[dict], total_steps: int) -> dict:
    best = {name: min((p for p in points if p["optim"] == name), key=lambda p: p["final_loss"])
            for name in ("adamw", "muon")}
    target = best["adamw"]["final_loss"]
    muon = best["muon"]
    reach = next((s for s, loss in zip(muon["steps"], muon["loss"], strict=True) if loss <= target), None)
    return {"best_lr": {k: v["lr"] for k, v in best.items()}, "adamw_final_loss": target,
            "muon_final_loss": muon["final_loss"], "muon_steps_to_adamw_final": reach,
            "ratio": None if reach is None else reach / total_steps}


def print_table(result: dict) -> None:
    points = result["points"]
    steps = points[0]["steps"]
    print(f"{'optim':6} {'lr':>8} " + " ".join(f"{s:>6}" for s in steps))
    for p in points:
        print(f"{p['optim']:6} {p['lr']:8.2g} " + " ".join(f"{x:6.3f}" for x in p["loss"]))
    s = result["summary"]
    print(f"best lr: AdamW {s['best_lr']['adamw']:g} (final {s['adamw_final_loss']:.4f}), Muon "
          f"{s['best_lr']['muon']:g} (final {s['muon_final_loss']:.4f}); Muon reaches AdamW's final loss at step "
          f"{s['muon_steps_to_adamw_final']} of {result['total_steps']} (ratio {s['ratio']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/k3_tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2])
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/muon_sweep_k3_tiny_cpu.json")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved result and exit")
    args = p.parse_args()
    if args.show:
        print_table(json.loads(Path(args.show).read_text()))
        return
    torch.set_num_threads(1)
    total = from_dict(RunConfig, load_recipe(args.recipe, args.overrides)).train.steps
    points = []
    for name in ("adamw", "muon"):
        for lr in args.lrs:
            points.append(run_point(args.recipe, args.overrides, name, lr, args.log_every))
            print(f"{name} lr={lr:g}: final {points[-1]['final_loss']:.4f} ({points[-1]['seconds']:.0f} s)", flush=True)
    result = {"recipe": args.recipe, "overrides": args.overrides, "total_steps": total, "points": points,
              "summary": summarise(points, total)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
