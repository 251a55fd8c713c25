"""train.deterministic end to end through `moontrain launch`: two runs bitwise equal, a stop/resume bitwise
equal to the uninterrupted run, and the step-time cost against train.deterministic=false.

    python benchmarks/check_determinism.py [--recipe recipes/k3_small.yaml] [--nproc 1] [--steps 8]
                                           [--work runs/determinism] [--out FILE.json] [key=value ...]

Runs (each a fresh `moontrain launch`, log_every=1, no wandb):
  A  deterministic, checkpoint at steps/2 (the only one kept; no final save)
  B  deterministic, no checkpoint                    -> loss and grad norm of every step == A's, bitwise
  C  deterministic, resumed from A's checkpoint       -> steps/2+1 .. steps == A's, bitwise
  D  train.deterministic=false, no checkpoint         -> the step-time baseline (and whether it differs)
The per-step loss and grad norm are compared as the exact floats of metrics.jsonl (one step per record).
Step time: the median over steps 3.. of each run (the first steps compile and warm up).
Exit status 1 when a bitwise check fails. Extra key=value arguments go to every run (e.g.
parallel.ep=1 model.num_layers=8); --only A,B runs a subset (the rest is read back from --work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RUNS = ("A", "B", "C", "D")


def _launch(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "moontrain.cli", "launch", args.recipe, "--nproc", str(args.nproc),
           f"train.run_dir={run_dir}", f"train.steps={args.steps}", "train.log_every=1", "metrics.wandb=false",
           *args.overrides, *extra]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _mismatch(got: dict[int, dict], want: dict[int, dict], steps: range) -> str | None:
    for step in steps:
        for key in ("loss", "grad_norm"):
            if got[step][key] != want[step][key]:
                return f"step {step} {key}: {got[step][key]!r} != {want[step][key]!r}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/k3_small.yaml")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--work", default="runs/determinism")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated subset of A,B,C,D to run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.steps < 4 or args.steps % 2:
        parser.error("--steps must be even and >= 4")
    work, half = Path(args.work), args.steps // 2
    ckpt = work / "A" / "checkpoints" / f"step_{half:08d}"
    det = ["train.deterministic=true"]
    plan = {
        "A": [*det, f"checkpoint.every={half}", "checkpoint.keep_last=1", "checkpoint.save_final=false"],
        "B": [*det, "checkpoint.save_final=false"],
        "C": [*det, f"checkpoint.resume={ckpt}", "checkpoint.save_final=false"],
        "D": ["train.deterministic=false", "checkpoint.save_final=false"],
    }
    for name in args.only.split(","):
        _launch(args, work / name, plan[name])

    rec = {name: _records(work / name) for name in RUNS if (work / name / "metrics.jsonl").is_file()}
    every, second_half = range(1, args.steps + 1), range(half + 1, args.steps + 1)
    summary: dict = {"recipe": args.recipe, "nproc": args.nproc, "steps": args.steps, "overrides": args.overrides}
    failed = False
    for name, steps, what in (("B", every, "two deterministic runs"), ("C", second_half, "stop/resume vs one run")):
        if "A" in rec and name in rec:
            bad = _mismatch(rec[name], rec["A"], steps)
            summary[what] = bad or "bitwise equal"
            failed |= bad is not None
            print(f"{what}: {bad or 'bitwise equal'} (loss and grad norm, steps {steps.start}-{steps.stop - 1})")
    if "A" in rec and "D" in rec:
        summary["deterministic=false vs A"] = _mismatch(rec["D"], rec["A"], every) or "bitwise equal"
    times = {name: statistics.median(rec[name][s]["step_time_s"] for s in range(3, args.steps + 1))
             for name in ("A", "B", "D") if name in rec}
    summary["median_step_time_s"] = times
    if "D" in times and ("A" in times or "B" in times):
        det_s = times["B"] if "B" in times else times["A"]
        summary["deterministic_cost"] = det_s / times["D"] - 1
        print(f"step time: deterministic {det_s * 1e3:.1f} ms, default {times['D'] * 1e3:.1f} ms "
              f"({summary['deterministic_cost']:+.1%})")
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
