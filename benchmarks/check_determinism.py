"""train.deterministic end to end through `moontrain launch`: two runs bitwise equal, a stop/resume bitwise
equal to the uninterrupted run, and the step-time cost against train.deterministic=false; or (--profile)
where the cost goes.

    python benchmarks/check_determinism.py [--recipe recipes/k3_small.yaml] [--nproc 1] [--steps 10]
                                           [--work runs/determinism] [--out FILE.json] [--only A,B,D]
                                           [--profile] [key=value ...]

Runs (each a fresh `moontrain launch`, log_every=1, no wandb, no checkpoint unless said):
  A  deterministic
  B  deterministic                         -> loss and grad norm of every step == A's, bitwise
  P  deterministic, SIGTERM to the launcher once step steps/2 is logged: the ranks finish the step they
     are in, save the only checkpoint (step k) and exit 0         -> steps 1..k == A's
  C  deterministic, resumed from P's checkpoint                   -> steps k+1..steps == A's, bitwise
  D  train.deterministic=false             -> the step-time baseline (and whether it differs from A)
The per-step loss and grad norm are compared as the exact floats of metrics.jsonl (one step per record).
Step time: the median over steps 3.. (the first steps compile and warm up). Exit status 1 when a bitwise
check fails. Extra key=value arguments go to every run (e.g. parallel.ep=1 train.micro_batch_size=2);
--only runs a subset, the others' metrics are read back from --work (so the checks can be split over
several commands).

--profile (instead of the runs): benchmarks/diagnostics/profile_determinism.py under torchrun, once with
train.deterministic=false and once with true (3 warm-up steps, 3 timed, one profiled), then the step times
and the kernel classes of both side by side, and the --top kernels whose CUDA time differs most between
the two modes (what deterministic mode still costs, or what it replaced).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from moontrain.checkpoint.store import list_checkpoints

RUNS = ("A", "B", "P", "C", "D")


def _command(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "moontrain.cli", "launch", args.recipe, "--nproc", str(args.nproc),
            f"train.run_dir={run_dir}", f"train.steps={args.steps}", "train.log_every=1", "metrics.wandb=false",
            "checkpoint.resume=none", "checkpoint.every=0", "checkpoint.save_final=false", *args.overrides, *extra]


def _launch(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> None:
    cmd = _command(args, run_dir, extra)
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _launch_and_stop(args: argparse.Namespace, run_dir: Path, extra: list[str], at_step: int) -> None:
    """Launch, send SIGTERM to the launcher once `at_step` is logged, expect exit 0."""
    cmd = _command(args, run_dir, extra)
    print("+ " + " ".join(cmd) + f"   (SIGTERM after step {at_step})", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    pattern = re.compile(rf"^step +{at_step}/{args.steps} ")
    for line in proc.stdout:
        print(line, end="", flush=True)
        if pattern.match(line):
            proc.send_signal(signal.SIGTERM)
    if proc.wait() != 0:
        raise SystemExit(f"the preempted run exited {proc.returncode}, expected 0")


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _mismatch(got: dict[int, dict], want: dict[int, dict], steps: range) -> str | None:
    for step in steps:
        for key in ("loss", "grad_norm"):
            if got[step][key] != want[step][key]:
                return f"step {step} {key}: {got[step][key]!r} != {want[step][key]!r}"
    return None


def _profile(args: argparse.Namespace, work: Path) -> dict:
    results = {}
    for det in ("false", "true"):
        out = work / f"profile_deterministic_{det}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(Path(__file__).parent / "diagnostics" / "profile_determinism.py"), "--out", str(out), args.recipe,
               f"train.run_dir={work / f'profile_{det}'}", "metrics.wandb=false", *args.overrides,
               f"train.deterministic={det}"]
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        results[det] = json.loads(out.read_text())
    comparison = compare_profiles(results["false"], results["true"], args.top)
    print_comparison(comparison)
    return comparison


def compare_profiles(default: dict, det: dict, top: int) -> dict:
    """Two profile_determinism.py results -> step times, cost, classes and the `top` kernels by |CUDA time
    difference| (deterministic - default), in ms."""
    def per_name(result: dict) -> dict[str, dict]:
        return {row["name"]: row for row in result["kernels"]}

    a, b = per_name(default), per_name(det)
    kernels = [{"name": name, "class": (a.get(name) or b[name])["class"],
                "default_ms": a[name]["total_us"] / 1e3 if name in a else 0.0,
                "deterministic_ms": b[name]["total_us"] / 1e3 if name in b else 0.0}
               for name in a.keys() | b.keys()]
    for row in kernels:
        row["delta_ms"] = row["deterministic_ms"] - row["default_ms"]
    kernels.sort(key=lambda row: (-abs(row["delta_ms"]), row["name"]))
    classes = [{"class": name, "default_ms": default["classes"].get(name, 0.0) / 1e3,
                "deterministic_ms": det["classes"].get(name, 0.0) / 1e3}
               for name in default["classes"].keys() | det["classes"].keys()]
    for row in classes:
        row["delta_ms"] = row["deterministic_ms"] - row["default_ms"]
    classes.sort(key=lambda row: (-row["delta_ms"], row["class"]))
    step = {"default": default["step_time_s"], "deterministic": det["step_time_s"]}
    cost = step["deterministic"] / step["default"] - 1 if step["default"] and step["deterministic"] else None
    return {"median_step_time_s": step, "deterministic_cost": cost, "classes": classes, "kernels": kernels[:top]}


def print_comparison(c: dict) -> None:
    step = c["median_step_time_s"]
    if c["deterministic_cost"] is not None:
        print(f"\nstep time: deterministic {step['deterministic'] * 1e3:.1f} ms, default {step['default'] * 1e3:.1f} ms "
              f"({c['deterministic_cost']:+.1%})")
    print(f"\n{'kernel class':<24}{'default ms':>12}{'determ. ms':>12}{'delta ms':>10}")
    for row in c["classes"]:
        print(f"{row['class']:<24}{row['default_ms']:>12.2f}{row['deterministic_ms']:>12.2f}{row['delta_ms']:>+10.2f}")
    print(f"\n{'default ms':>10}{'determ. ms':>12}{'delta ms':>10}  kernel (largest |delta| first)")
    for row in c["kernels"]:
        print(f"{row['default_ms']:>10.2f}{row['deterministic_ms']:>12.2f}{row['delta_ms']:>+10.2f}  {row['name'][:100]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/k3_small.yaml")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--work", default="runs/determinism")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the runs: one profiled step per mode and the kernels that differ")
    parser.add_argument("--top", type=int, default=25, help="--profile: kernels listed")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.profile:
        comparison = _profile(args, Path(args.work))
        if args.out:
            Path(args.out).write_text(json.dumps(comparison, indent=1) + "\n")
        return 0
    if args.steps < 6:
        parser.error("--steps must be >= 6 (a stop near the middle, and steps after the warm-up to time)")
    work, half = Path(args.work), args.steps // 2
    det = ["train.deterministic=true"]
    for name in args.only.split(","):
        if name in ("A", "B"):
            _launch(args, work / name, det)
        elif name == "P":
            _launch_and_stop(args, work / name, det, half)
        elif name == "C":
            (ckpt,) = list_checkpoints(work / "P" / "checkpoints")
            _launch(args, work / name, [*det, f"checkpoint.resume={ckpt}"])
        elif name == "D":
            _launch(args, work / name, ["train.deterministic=false"])
        else:
            parser.error(f"--only: unknown run {name!r}; runs are {','.join(RUNS)}")

    rec = {name: _records(work / name) for name in RUNS if (work / name / "metrics.jsonl").is_file()}
    every = range(1, args.steps + 1)
    summary: dict = {"recipe": args.recipe, "nproc": args.nproc, "steps": args.steps, "overrides": args.overrides}
    checks = [("B", every, "two deterministic runs")]
    if "P" in rec:
        stopped = max(rec["P"])
        summary["preempted_after_step"] = stopped
        checks.append(("P", range(1, stopped + 1), "preempted run before its stop"))
        checks.append(("C", range(stopped + 1, args.steps + 1), "resumed run vs one run"))
    failed = False
    for name, steps, what in checks:
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
