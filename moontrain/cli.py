"""The `moontrain` command.

    moontrain launch RECIPE [key=value ...] [--nproc N] [--nnodes N --node-rank I --rdzv-endpoint HOST:PORT]
                     [--dry-run [--device cuda|cpu]]

launch validates the recipe (strict loader, world-size checks, data paths and tokenizer, and on a CPU host
the memory estimate) before anything starts, then runs torchrun with one worker per rank
(`moontrain.trainer.worker`); the worker picks nccl on GPU and gloo on CPU. A configuration or data error
in a worker is printed as the worker's one line, not torchrun's report. --dry-run prints the parallel
layout, parameter counts, a per-rank memory estimate and the data checks without allocating anything
(the model is built on the meta device).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from moontrain.config import RunConfig, from_dict, load_recipe

EPILOG = """\
examples:
  moontrain launch recipes/k3_tiny.yaml                       train the toy model on CPU (2 ranks, EP=2)
  moontrain launch recipes/k3_tiny.yaml train.steps=200 data.tokenizer=recipes/data/tiny_tokenizer.json \\
      model.vocab_size=384 eval.every=20 eval.data.path=recipes/data/tiny_corpus.jsonl
  moontrain launch recipes/k3_small.yaml data.path=/data/fineweb.parquet data.tokenizer=/models/k2/tokenizer.json
  moontrain launch recipes/k3.yaml --nproc 8 --nnodes 64 --dry-run   plan a cluster run, allocate nothing

overrides (dotted keys of the recipe, checked strictly):
  data.path=FILE|DIR|GLOB   jsonl / parquet / text / save_to_disk / .bin / .npy (input_ids columns need no
                            tokenizer); data.sources.NAME.path=... data.sources.NAME.weight=0.7 for a mixture
  data.tokenizer=bytes|tokenizer.json|DIR   eval.every=N eval.steps=N eval.data.path=FILE
  train.steps train.seq_len train.global_batch_size train.run_dir   parallel.ep   experts.backend

runs never lose work: relaunching the same command resumes from the latest checkpoint in the run
directory (checkpoint.resume=auto); checkpoint.resume=none starts over (the earlier run is moved aside).
Metrics: <run_dir>/metrics.jsonl, an offline wandb run under <run_dir>/wandb, expert-load heatmaps
under <run_dir>/heatmaps.
"""


def _parser() -> argparse.ArgumentParser:
    launch = argparse.ArgumentParser(prog="moontrain launch", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="train a recipe under torchrun (or plan it with --dry-run)",
                                     epilog=EPILOG)
    launch.add_argument("recipe", help="a YAML recipe, e.g. recipes/k3_tiny.yaml")
    launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=4")
    launch.add_argument("--nproc", type=int, default=None,
                        help="processes per node (default: GPUs on this host, or parallel.ep on CPU)")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    launch.add_argument("--dry-run", action="store_true",
                        help="print layout, parameters, memory and the data checks; run nothing")
    launch.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="dry-run target (default: cuda, i.e. bf16 compute unless the recipe says float32)")
    launch.add_argument("--no-memory-check", action="store_true",
                        help="launch a CPU run even when its memory estimate exceeds the available host memory")
    return launch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: moontrain launch RECIPE [key=value ...] [--nproc N] [--dry-run]\n\n"
              "moontrain trains Kimi-K3-like MoE models with expert parallelism (moonep).\n\n"
              "commands:\n  launch    train a recipe under torchrun, or plan it with --dry-run\n\n" + EPILOG
              + "\nmore: moontrain launch --help", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] != "launch":
        print(f"moontrain: error: unknown command {argv[0]!r}; the command is launch (see moontrain --help)",
              file=sys.stderr)
        return 2
    # subparsers cannot be combined with intermixed options, so the one command is matched by hand
    args = _parser().parse_intermixed_args(argv[1:])
    on_gpu = torch.cuda.is_available()
    try:
        cfg = from_dict(RunConfig, load_recipe(args.recipe, args.overrides))
        nproc = args.nproc if args.nproc is not None else _default_nproc(cfg)
        if nproc < 1 or args.nnodes < 1:
            raise ValueError(f"--nproc ({nproc}) and --nnodes ({args.nnodes}) must be >= 1")
        world = nproc * args.nnodes
        cfg.check_world(world)
        if args.nnodes > 1 and args.rdzv_endpoint is None:
            raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        from moontrain.planning.preflight import check_data, host_memory_line

        data_lines = check_data(cfg)
        cpu_run = args.device == "cpu" or (args.device is None and not on_gpu)
        memory_line, fits = host_memory_line(cfg, world, nproc) if cpu_run else ("", True)
        if not args.dry_run and not fits and not args.no_memory_check:
            raise ValueError(f"{memory_line}; make the model or batch smaller (model.*, train.global_batch_size, "
                             "train.seq_len), run on GPUs, or pass --no-memory-check")
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from moontrain.planning.report import dry_run_report

        print(dry_run_report(cfg, world, args.device or "cuda"))
        print("== checks ==")
        print("\n".join(data_lines + ([memory_line] if memory_line else [])))
        return 0
    cmd = torchrun_command(args.recipe, args.overrides, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint)
    print("moontrain: " + " ".join(cmd), flush=True)
    return run_workers(cmd)


def run_workers(cmd: list[str]) -> int:
    """Run torchrun; a worker's one-line error (MOONTRAIN_ERROR_FILE) replaces torchrun's own report."""
    with tempfile.TemporaryDirectory(prefix="moontrain-") as tmp:
        error_file = Path(tmp) / "error"
        proc = subprocess.Popen(cmd, env=dict(os.environ, MOONTRAIN_ERROR_FILE=str(error_file)),
                                stderr=subprocess.PIPE, text=True, bufsize=1)
        assert proc.stderr is not None

        def forward() -> None:  # live, until a worker has reported an error (what follows is torchrun's report)
            for line in proc.stderr:
                if not error_file.exists():
                    sys.stderr.write(line)
                    sys.stderr.flush()

        thread = threading.Thread(target=forward, daemon=True)
        thread.start()
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            rc = proc.wait()
        thread.join(timeout=5)
        if error_file.exists():
            print(error_file.read_text().strip(), file=sys.stderr, flush=True)
            return 2
        return rc


def torchrun_command(recipe: str, overrides: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None) -> list[str]:
    """The torchrun invocation: standalone rendezvous on one node, c10d at rdzv_endpoint on several."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", str(rdzv_endpoint)]
    else:
        cmd += ["--standalone"]
    return [*cmd, "-m", "moontrain.trainer.worker", recipe, *overrides]


def _default_nproc(cfg: RunConfig) -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return cfg.parallel.ep


if __name__ == "__main__":
    sys.exit(main())
