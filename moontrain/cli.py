"""The `moontrain` command.

    moontrain launch RECIPE [key=value ...] [--nproc N] [--nnodes N --node-rank I --rdzv-endpoint HOST:PORT]
                     [--dry-run [--device cuda|cpu]]

launch validates the recipe (strict loader, world-size checks) before anything starts, then runs
torchrun with one worker per rank (`moontrain.trainer.worker`); the worker picks nccl on GPU and gloo
on CPU. --dry-run prints the parallel layout, parameter counts and a per-rank memory estimate without
allocating anything (the model is built on the meta device).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.hosts import check_dry_run_host, check_ep_domain


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "launch":
        print("usage: moontrain launch RECIPE [key=value ...] [--nproc N] [--dry-run] (see --help)",
              file=sys.stderr)
        return 2
    # subparsers cannot be combined with intermixed options, so the one command is matched by hand
    launch = argparse.ArgumentParser(prog="moontrain launch",
                                     description="train a recipe under torchrun (or plan it with --dry-run)")
    launch.add_argument("recipe")
    launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=4")
    launch.add_argument("--nproc", type=int, default=None,
                        help="processes per node (default: GPUs on this host, or parallel.ep on CPU)")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    launch.add_argument("--rdzv-id", default=None,
                        help="rendezvous id, the same on every node (default: derived from train.run_dir)")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart all workers this many times after a failure (they resume from the latest "
                             "checkpoint of train.run_dir)")
    launch.add_argument("--dry-run", action="store_true", help="print layout, parameters and memory; run nothing")
    launch.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="dry-run target (default: cuda, i.e. bf16 compute unless the recipe says float32)")
    args = launch.parse_intermixed_args(argv[1:])
    try:
        cfg = from_dict(RunConfig, load_recipe(args.recipe, args.overrides))
        nproc = args.nproc if args.nproc is not None else _default_nproc(cfg)
        if nproc < 1 or args.nnodes < 1:
            raise ValueError(f"--nproc ({nproc}) and --nnodes ({args.nnodes}) must be >= 1")
        if args.dry_run:
            check_dry_run_host(args.device or "cuda", nproc)
        world = nproc * args.nnodes
        cfg.check_world(world)
        check_ep_domain(cfg.experts.backend, cfg.parallel.ep, nproc)
        if args.nnodes > 1 and args.rdzv_endpoint is None and not args.dry_run:
            raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from moontrain.planning.report import dry_run_report

        print(dry_run_report(cfg, world, args.device or "cuda"))
        return 0
    cmd = torchrun_command(args.recipe, args.overrides, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id or rdzv_id_for(cfg.train.run_dir),
                           max_restarts=args.max_restarts,
                           log_dir=Path(cfg.train.run_dir) / "logs" if args.nnodes > 1 else None)
    print("moontrain: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def torchrun_command(recipe: str, overrides: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None, max_restarts: int = 0,
                     log_dir: Path | None = None) -> list[str]:
    """The torchrun invocation: standalone rendezvous on one node, c10d at rdzv_endpoint on several (with a
    rendezvous id shared by the nodes); workers restarted up to max_restarts times; with log_dir (launch
    passes train.run_dir/logs on several nodes), each rank's output also goes to its own file under
    log_dir/node<node_rank>, and to the console with a rank prefix."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-id", str(rdzv_id or "moontrain")]
    else:
        cmd += ["--standalone"]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir / f"node{node_rank}"), "--tee", "3"]
    return [*cmd, "-m", "moontrain.trainer.worker", recipe, *overrides]


def rdzv_id_for(run_dir: str) -> str:
    """A rendezvous id every node derives alike from the run directory (same recipe and overrides)."""
    return "moontrain-" + hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]


def _default_nproc(cfg: RunConfig) -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return cfg.parallel.ep


if __name__ == "__main__":
    sys.exit(main())
