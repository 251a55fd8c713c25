"""The `moontrain` command.

    moontrain launch RECIPE [key=value ...] [--nproc N] [--nnodes N --node-rank I --rdzv-endpoint HOST:PORT]
                     [--dry-run [--device cuda|cpu]]

    moontrain export CHECKPOINT OUT_DIR [--dtype bfloat16|float32|float16] [--shard-gib G] [--tokenizer PATH]
    moontrain generate CHECKPOINT_OR_HF_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-p P --seed S]
    moontrain eval CHECKPOINT_OR_HF_DIR --data PATH [--seq-len T --batch-size B --batches N]

launch validates the recipe (strict loader, world-size checks, data paths and tokenizer, and on a CPU host
the memory estimate) before anything starts, then runs torchrun with one worker per rank
(`moontrain.trainer.worker`); the worker picks nccl on GPU and gloo on CPU. On one host the rendezvous store
is the launcher's own, on 127.0.0.1 (moontrain.parallel.job_store). A configuration or data error in a
worker is printed as the worker's one line, last, not torchrun's report; the ranks' output (tracebacks of
unexpected errors included) is forwarded as it comes. --dry-run prints the parallel
layout, parameter counts, a per-rank memory estimate and the data checks without allocating anything
(the model is built on the meta device).

SIGTERM / SIGINT to the launcher: the ranks finish the step, save and exit 0; a second signal aborts;
no rank outlives the launcher (moontrain.supervisor).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.hosts import check_dry_run_host, check_ep_domain
from moontrain.parallel.job_store import JobStore
from moontrain.supervisor import Supervisor

EPILOG = """\
examples:
  moontrain launch recipes/k3_tiny.yaml                       train the toy model on CPU (2 ranks, EP=2)
  moontrain launch recipes/k3_tiny.yaml train.steps=200 data.tokenizer=recipes/data/tiny_tokenizer.json \\
      model.vocab_size=384 eval.every=20 eval.data.path=recipes/data/tiny_corpus.jsonl
  moontrain launch recipes/k3_small.yaml data.path=/data/fineweb.parquet data.tokenizer=/models/k2/tokenizer.json
  moontrain launch recipes/k3.yaml --nproc 8 --nnodes 112 --dry-run  plan a cluster run, allocate nothing

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
    launch.add_argument("--rdzv-id", default=None,
                        help="rendezvous id, the same on every node (default: derived from train.run_dir)")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart all workers this many times after a failure (they resume from the latest "
                             "checkpoint of train.run_dir)")
    launch.add_argument("--dry-run", action="store_true",
                        help="print layout, parameters, memory and the data checks; run nothing")
    launch.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="dry-run target (default: cuda, i.e. bf16 compute unless the recipe says float32)")
    launch.add_argument("--no-memory-check", action="store_true",
                        help="launch a CPU run even when its memory estimate exceeds the available host memory")
    return launch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: moontrain launch RECIPE [key=value ...] [--nproc N] [--dry-run]\n\n"
              "moontrain trains Kimi-K3-like MoE models with expert parallelism (moonep).\n\n"
              "commands:\n  launch    train a recipe under torchrun, or plan it with --dry-run\n"
              "  export    write a checkpoint as a Hugging Face model directory\n"
              "  generate  sample text from a checkpoint or a Hugging Face directory\n"
              "  eval      held-out loss and perplexity of a checkpoint\n\n" + EPILOG
              + "\nmore: moontrain <command> --help", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] != "launch":
        print(f"moontrain: error: unknown command {argv[0]!r}; the commands are launch, {', '.join(COMMANDS)} "
              "(see moontrain --help)", file=sys.stderr)
        return 2
    # subparsers cannot be combined with intermixed options, so the one command is matched by hand
    args = _parser().parse_intermixed_args(argv[1:])
    on_gpu = torch.cuda.is_available()
    try:
        cfg = from_dict(RunConfig, load_recipe(args.recipe, args.overrides))
        nproc = args.nproc if args.nproc is not None else _default_nproc(cfg)
        if nproc < 1 or args.nnodes < 1:
            raise ValueError(f"--nproc ({nproc}) and --nnodes ({args.nnodes}) must be >= 1")
        if args.dry_run:
            check_dry_run_host(args.device or "cuda", nproc)
        world = nproc * args.nnodes
        cfg.check_world(world)
        check_ep_domain(cfg.experts.backend, cfg.parallel.ep, nproc, cfg.parallel.ep_hosts)
        if args.nnodes > 1 and args.rdzv_endpoint is None and not args.dry_run:
            raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        from moontrain.planning.preflight import check_data, host_memory_line

        data_lines = check_data(cfg)
        cpu_run = args.device == "cpu" or (args.device is None and not on_gpu and not args.dry_run)
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
    store = JobStore() if args.nnodes == 1 else None
    cmd = torchrun_command(args.recipe, args.overrides, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id or rdzv_id_for(cfg.train.run_dir),
                           max_restarts=args.max_restarts,
                           log_dir=Path(cfg.train.run_dir) / "logs" if args.nnodes > 1 else None,
                           local_rdzv=store.torchrun_args() if store is not None else None)
    print("\n".join(f"moontrain: {line}" for line in data_lines), flush=True)
    print("moontrain: " + " ".join(cmd), flush=True)
    try:
        return run_workers(cmd, env=store.env() if store is not None else None)
    finally:
        if store is not None:
            store.close()


def run_workers(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run torchrun under the Supervisor (signals, no orphans), with `env` added; every line the ranks
    write to stderr is forwarded, and a worker's one-line error (MOONTRAIN_ERROR_FILE) is printed last, in
    place of torchrun's own report (moontrain.torchrun)."""
    with tempfile.TemporaryDirectory(prefix="moontrain-") as tmp:
        error_file = Path(tmp) / "error"

        def forward(line: str) -> None:
            sys.stderr.write(line)
            sys.stderr.flush()

        rc = Supervisor(cmd, env={**(env or {}), "MOONTRAIN_ERROR_FILE": str(error_file)}, on_stderr=forward).run()
        if error_file.exists():
            print(error_file.read_text().strip(), file=sys.stderr, flush=True)
            return 2
        return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention


def torchrun_command(recipe: str, overrides: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None, max_restarts: int = 0,
                     log_dir: Path | None = None, local_rdzv: list[str] | None = None) -> list[str]:
    """The torchrun invocation (moontrain.torchrun): on one node the rendezvous options `local_rdzv` (launch
    passes its loopback store's, JobStore.torchrun_args), else standalone; c10d at rdzv_endpoint on several
    (with a rendezvous id shared by the nodes); workers restarted up to max_restarts times; with log_dir
    (launch passes train.run_dir/logs on several nodes), each rank's output also goes to its own file under
    log_dir/node<node_rank>, and to the console with a rank prefix."""
    cmd = [sys.executable, "-m", "moontrain.torchrun", "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-id", str(rdzv_id or "moontrain")]
    else:
        cmd += local_rdzv or ["--standalone"]
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


def _device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def export_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moontrain export",
                                     description="write a checkpoint as a Hugging Face model directory")
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/k3_tiny/checkpoints/step_00000060")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--shard-gib", type=float, default=5.0, help="shard size bound in GiB")
    parser.add_argument("--tokenizer", default=None, help="tokenizer file or directory (default: the run's)")
    args = parser.parse_args(argv)
    from moontrain.checkpoint.hf import export_hf

    try:
        out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype, shard_bytes=int(args.shard_gib * 2**30),
                        tokenizer=args.tokenizer)
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def generate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moontrain generate",
                                     description="sample text from a checkpoint or a Hugging Face directory")
    parser.add_argument("model", help="a checkpoint directory or an exported (or DeepSeek-V3 / K2) HF directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    from moontrain.generate.decoder import generate
    from moontrain.generate.load import load_model

    try:
        model, tokenizer = load_model(args.model, device=_device(args.device))
        prompt = tokenizer.encode_batch([args.prompt])[0]
        if not prompt:
            raise ValueError("--prompt encodes to no tokens; give some text")
        out = generate(model, torch.tensor([prompt], device=model.embed.weight.device),
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, eos_id=tokenizer.eos_id)
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    print(tokenizer.decode(out[0].tolist()))
    return 0


def eval_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moontrain eval", description="held-out loss and perplexity")
    parser.add_argument("model", help="a checkpoint directory or a Hugging Face directory")
    parser.add_argument("--data", required=True, help="a jsonl / parquet / text file or directory of documents")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    from moontrain.data.config import SourceConfig
    from moontrain.generate.evaluate import evaluate
    from moontrain.generate.load import load_model

    try:
        model, tokenizer = load_model(args.model, device=_device(args.device),
                                      max_tokens=args.batch_size * args.seq_len)
        result = evaluate(model, tokenizer, SourceConfig(path=args.data), seq_len=args.seq_len,
                          batch_size=args.batch_size, num_batches=args.batches)
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  ({result.tokens} tokens)")
    return 0


COMMANDS = {"export": export_command, "generate": generate_command, "eval": eval_command}


if __name__ == "__main__":
    sys.exit(main())
