"""Peak host memory of the Hugging Face export (issue 17): a checkpoint of a recipe's model, exported in a
child process whose peak RSS is measured (VmHWM of /proc/self/status: getrusage's ru_maxrss would carry
the parent's RSS over the fork) against a child that only imports the same
modules.

    PYTHONPATH=$PWD python benchmarks/bench_export.py recipes/k3_small.yaml --out /tmp/k3_small_export --device cuda \\
        --json benchmarks/results/bench_export_k3_small_<date>.json
    PYTHONPATH=$PWD python benchmarks/bench_export.py recipes/k3_tiny.yaml --out /tmp/k3_tiny_export --device cpu   # CPU check

The checkpoint holds the initial weights (train.seed; no step is taken: the export's cost depends on
shapes, not values) saved by a one-process trainer with the local experts backend (all experts on the
device). The export is checked afterwards: every exported tensor equals the checkpoint's canonical
tensor after the HF layout change and the bf16 cast (read back through the import path, bit for bit).
Trailing key=value arguments are recipe overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from moontrain.checkpoint.hf import read_hf
from moontrain.checkpoint.store import open_checkpoint
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
import moontrain.checkpoint.hf
from moontrain.cli import main
rc = main(sys.argv[1:]) if len(sys.argv) > 1 else 0
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("MAXRSS_KIB", hwm.split()[1], flush=True)
sys.exit(rc)
"""


def _child(args: list[str]) -> tuple[float, float, str]:
    """(peak RSS in GiB, seconds, stdout) of `moontrain <args>` in a fresh interpreter (no args: imports only)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    kib = int(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("MAXRSS_KIB")))
    return kib / 2**20, seconds, done.stdout


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shard-gib", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    over = ["experts.backend=local", "parallel.ep=1", "data.source=markov", "metrics.wandb=false",
            f"train.run_dir={args.out / 'run'}", *args.overrides]
    cfg = from_dict(RunConfig, load_recipe(args.recipe, over))
    trainer = Trainer(cfg, single_process_layout(torch.device(args.device)))
    ckpt = trainer.save_checkpoint()
    del trainer
    _, source = open_checkpoint(ckpt)
    model_keys = [k for k in source.names() if k.startswith("model.")]
    largest = max(torch.Size(source.shape(k)).numel() * 4 for k in model_keys)

    base_gib, _, _ = _child([])
    hf_dir = args.out / "hf"
    peak_gib, seconds, _ = _child(["export", str(ckpt), str(hf_dir), "--dtype", args.dtype,
                                   "--shard-gib", str(args.shard_gib)])

    cfg_hf, hf = read_hf(hf_dir)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    for key in model_keys:  # the import path undoes the layout change: equal to the cast canonical tensor
        want = source.full(key)
        got = hf.full(key[len("model."):])
        if not (key.endswith("router.weight") or key.endswith("score_bias_E")):
            want = want.to(dtype)
        assert torch.equal(got, want), key
    assert cfg_hf == cfg.model
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    result = {
        "recipe": args.recipe, "overrides": args.overrides, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"),
        "host": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "checkpoint_gib": _dir_bytes(ckpt) / 2**30, "export_gib": _dir_bytes(hf_dir) / 2**30,
        "shards": len(set(index["weight_map"].values())), "shard_bound_gib": args.shard_gib,
        "largest_tensor_fp32_gib": largest / 2**30,
        "peak_rss_gib": peak_gib, "import_only_rss_gib": base_gib, "export_rss_over_imports_gib": peak_gib - base_gib,
        "export_seconds": seconds, "verified_tensors": len(model_keys),
    }
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
