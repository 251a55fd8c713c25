"""The `moontrain` command.

    moontrain launch RECIPE [key=value ...] [--nproc N] [--nnodes N --node-rank I --rdzv-endpoint HOST:PORT]
                     [--dry-run [--device cuda|cpu]]

    moontrain export CHECKPOINT OUT_DIR [--dtype bfloat16|float32|float16] [--shard-gib G] [--tokenizer PATH]
    moontrain generate CHECKPOINT_OR_HF_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-p P --seed S]
                       [--tokenizer PATH]
    moontrain eval CHECKPOINT_OR_HF_DIR --data PATH [--seq-len T --batch-size B --batches N] [--tokenizer PATH]
    moontrain checkpoints RUN_DIR [--quick]
    moontrain --version

launch validates the recipe (strict loader, world-size checks, data paths, columns and tokenizer, on a CPU
host the memory estimate, and the checkpoint it would resume: planning.resume_check) before anything starts,
says what it will do (data, fresh run or resume, the checkpoint policy), then runs torchrun with one worker
per rank (`moontrain.trainer.worker`), on a GPU host with the kernel warm-up's processes started just before
it (moontrain.trainer.warmup_pool); the worker picks nccl on GPU and gloo on CPU. On one host the
rendezvous store is the launcher's own, on 127.0.0.1 (moontrain.parallel.job_store). Everything printed also
goes to <run_dir>/console.log (moontrain.console); the ranks' output (tracebacks of unexpected errors
included) is forwarded as it comes, and a configuration or data error in a worker is printed as the
worker's one line, last, not torchrun's report. A run already at train.steps is reported finished and
nothing starts. --dry-run prints the parallel layout, parameter counts, a per-rank memory estimate and the
data checks for this host's device (--device to choose) without allocating anything (the model is built on
the meta device).

SIGTERM / SIGINT to the launcher (or to the whole process group: Ctrl-C, a scheduler): the ranks finish
the step, save once and exit 0, and so does the launcher; a second signal aborts; no rank outlives the
launcher (moontrain.supervisor).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.console import Console, console_path
from moontrain.parallel.hosts import check_dry_run_host, check_ep_domain
from moontrain.parallel.job_store import JobStore
from moontrain.supervisor import Supervisor
from moontrain.trainer.warmup_pool import REPORT_ENV, launcher_warmup, publish_in_background

EPILOG = """\
examples:
  moontrain launch recipes/k3_tiny.yaml                       train the toy model on CPU (2 ranks, EP=2)
  moontrain launch recipes/k3_tiny.yaml train.steps=200 data.tokenizer=recipes/data/tiny_tokenizer.json \\
      model.vocab_size=384 eval.every=20 eval.data.path=recipes/data/tiny_heldout.jsonl
  moontrain launch recipes/k3_small.yaml data.path=/data/fineweb.parquet data.tokenizer=/models/k2/tokenizer.json
  moontrain launch recipes/k3.yaml --nproc 8 --nnodes 112 --dry-run --device cuda   plan a GPU cluster run

overrides (dotted keys of the recipe, checked strictly):
  data.path=FILE|DIR|GLOB   jsonl / parquet / text / save_to_disk / .bin / .npy (input_ids columns need no
                            tokenizer); data.sources.NAME.path=... data.sources.NAME.weight=0.7 for a mixture
  data.tokenizer=bytes|tokenizer.json|DIR   eval.every=N eval.steps=N eval.data.path=FILE
  train.steps train.seq_len train.global_batch_size train.run_dir   parallel.ep   experts.backend

runs never lose work: a checkpoint every checkpoint.every_minutes of training (30 unless the recipe says),
and relaunching the same command resumes from the latest one in the run directory (checkpoint.resume=auto);
checkpoint.resume=none starts over (the earlier run is moved aside). Paths in a recipe (data, tokenizer,
eval data, init_from) are relative to the recipe file; on the command line, to the working directory.
In <run_dir>: config.yaml (the resolved config), console.log (everything printed), metrics.jsonl, an
offline wandb run under wandb/, expert-load heatmaps under heatmaps/, checkpoints/ (moontrain checkpoints).
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
                        help="dry-run target (default: this host's: cuda with a GPU, bf16 compute unless the recipe "
                             "says float32; else cpu)")
    launch.add_argument("--no-memory-check", action="store_true",
                        help="launch a CPU run even when its memory estimate exceeds the available host memory")
    return launch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before any worker started (a running job's is the Supervisor's)
        print("moontrain: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] in ("--version", "-V"):
        print(f"moontrain {version('moontrain')} (torch {torch.__version__}, Python {sys.version.split()[0]})")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: moontrain launch RECIPE [key=value ...] [--nproc N] [--dry-run]\n\n"
              "moontrain trains Kimi-K3-like MoE models with expert parallelism (moonep).\n\n"
              "commands:\n  launch       train a recipe under torchrun, or plan it with --dry-run\n"
              "  export       write a checkpoint as a Hugging Face model directory\n"
              "  generate     sample text from a checkpoint or a Hugging Face directory\n"
              "  eval         held-out loss and perplexity of a checkpoint\n"
              "  checkpoints  list a run's checkpoints: step, size, finite, digests\n\n" + EPILOG
              + "\nmore: moontrain <command> --help; moontrain --version", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] != "launch":
        print(f"moontrain: error: unknown command {argv[0]!r}; the commands are launch, {', '.join(COMMANDS)} "
              "(see moontrain --help)", file=sys.stderr)
        return 2
    # subparsers cannot be combined with intermixed options, so the one command is matched by hand
    args = _parser().parse_intermixed_args(argv[1:])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # --dry-run plans for this host
    try:
        cfg = from_dict(RunConfig, load_recipe(args.recipe, args.overrides))
        nproc = args.nproc if args.nproc is not None else _default_nproc(cfg)
        if nproc < 1 or args.nnodes < 1:
            raise ValueError(f"--nproc ({nproc}) and --nnodes ({args.nnodes}) must be >= 1")
        if args.dry_run:
            check_dry_run_host(device, nproc)
        world = nproc * args.nnodes
        cfg.check_world(world)
        check_ep_domain(cfg.experts.backend, cfg.parallel.ep, nproc, cfg.parallel.ep_hosts)
        if args.nnodes > 1 and args.rdzv_endpoint is None and not args.dry_run:
            raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        from moontrain.planning.preflight import check_data, host_memory_line
        from moontrain.planning.resume_check import check_resume

        data_lines = check_data(cfg)
        memory_line, fits = host_memory_line(cfg, world, nproc) if device == "cpu" else ("", True)
        if not args.dry_run and not fits and not args.no_memory_check:
            raise ValueError(f"{memory_line}; make the model or batch smaller (model.*, train.global_batch_size, "
                             "train.seq_len), run on GPUs, or pass --no-memory-check")
        resume = None if args.dry_run else check_resume(cfg)
        warmup = None if args.dry_run else launcher_warmup(cfg.train.kernel_warmup, cfg.train.kernel_warmup_workers,
                                                           cuda=torch.cuda.is_available())
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from moontrain.planning.report import dry_run_report

        print(dry_run_report(cfg, world, device))
        print("== checks ==")
        print("\n".join(data_lines + ([memory_line] if memory_line else [])))
        return 0
    run_dir = cfg.train.run_dir
    if resume is not None and resume.step == cfg.train.steps:
        print(f"moontrain: {run_dir} is finished: {resume.checkpoint} is at train.steps={cfg.train.steps}; raise "
              "train.steps to train on, or set checkpoint.resume=none to start over (the earlier checkpoints are "
              "moved aside)")
        return 0
    store = JobStore() if args.nnodes == 1 else None
    cmd = torchrun_command(args.recipe, args.overrides, nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id or rdzv_id_for(run_dir),
                           max_restarts=args.max_restarts,
                           log_dir=Path(run_dir) / "logs" if args.nnodes > 1 else None,
                           local_rdzv=store.torchrun_args() if store is not None else None)
    console = Console(console_path(run_dir, args.node_rank), argv)
    try:
        start = (f"resuming {resume.checkpoint} (step {resume.step} of {cfg.train.steps})" if resume is not None
                 else f"a new run in {run_dir} ({cfg.train.steps} steps)")
        lines = [*data_lines, start, cfg.checkpoint.describe(run_dir), f"console: {console.path}",
                 " ".join(cmd)]
        console.out("".join(f"moontrain: {line}\n" for line in lines))
        env = store.env() if store is not None else {}
        if warmup is not None:  # the kernels compile while torchrun and the ranks start; the ranks wait for its report
            console.out(f"moontrain: {warmup.start()}\n")
            env[REPORT_ENV] = str(warmup.report_path)
            publish_in_background(warmup)
        return run_workers(cmd, console, env=env)
    finally:
        console.close()
        if warmup is not None:
            warmup.close()
        if store is not None:
            store.close()


def run_workers(cmd: list[str], console: Console | None = None, env: dict[str, str] | None = None) -> int:
    """Run torchrun under the Supervisor (signals, no orphans), with `env` added, its output through `console`:
    every line the ranks write to stderr is forwarded (tracebacks included), and a worker's one-line error
    (MOONTRAIN_ERROR_FILE) is printed last, in place of torchrun's own report (moontrain.torchrun). Without a
    console, to this process's stdout and stderr only."""
    console = console if console is not None else Console(None, [])
    with tempfile.TemporaryDirectory(prefix="moontrain-") as tmp:
        error_file = Path(tmp) / "error"
        # OMP_NUM_THREADS=1 is torchrun's own default for several ranks, set here to spare its banner (the CPU
        # worker sizes torch's threads itself); unbuffered ranks: their piped stdout arrives line by line
        env = {**(env or {}), "MOONTRAIN_ERROR_FILE": str(error_file), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        rc = Supervisor(cmd, env=env, on_stderr=console.err, on_stdout=console.out).run()
        if error_file.exists():
            console.err(error_file.read_text().strip())
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


TOKENIZER_HELP = ("tokenizer.json, tokenizer directory or bytes (default: the one the checkpoint records or the "
                  "export holds; one of another vocabulary size is refused)")


def export_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moontrain export",
                                     description="write a checkpoint as a Hugging Face model directory")
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/k3_tiny/checkpoints/step_00000060")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--shard-gib", type=float, default=5.0, help="shard size bound in GiB")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json, tokenizer directory or bytes (default: the one the checkpoint records)")
    args = parser.parse_args(argv)
    from moontrain.checkpoint.hf import describe_export, export_hf

    try:
        out = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype, shard_bytes=int(args.shard_gib * 2**30),
                        tokenizer=args.tokenizer)
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    print(f"moontrain: {describe_export(out)}")
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
    parser.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    args = parser.parse_args(argv)
    from moontrain.generate.decoder import generate
    from moontrain.generate.load import load_model

    try:
        model, tokenizer = load_model(args.model, device=_device(args.device), tokenizer=args.tokenizer)
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
    parser.add_argument("--batches", type=int, default=None,
                        help="evaluate only the first N batches (default: every token of the file, once)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    args = parser.parse_args(argv)
    from moontrain.data.config import SourceConfig
    from moontrain.generate.evaluate import evaluate
    from moontrain.generate.load import load_model

    try:
        model, tokenizer = load_model(args.model, device=_device(args.device),
                                      max_tokens=args.batch_size * args.seq_len, tokenizer=args.tokenizer)
        result = evaluate(model, tokenizer, SourceConfig(path=args.data), seq_len=args.seq_len,
                          batch_size=args.batch_size, num_batches=args.batches)
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    what = ("every token once" if result.tokens == result.available else
            f"the first {args.batches} batches of {result.available:,} tokens")
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  ({result.tokens:,} tokens of {args.data}: "
          f"{what})")
    return 0


def checkpoints_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moontrain checkpoints",
                                     description="list a run's checkpoints: step, size, finite, tokens, digests")
    parser.add_argument("run_dir", help="a run directory (train.run_dir) or a checkpoints folder")
    parser.add_argument("--quick", action="store_true", help="skip reading every file to check its digests")
    args = parser.parse_args(argv)
    from moontrain.checkpoint.inventory import checkpoints_root, inventory

    try:
        lines, ok = inventory(checkpoints_root(Path(args.run_dir)), verify=not args.quick)
    except ValueError as err:
        print(f"moontrain: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if ok else 1


COMMANDS = {"export": export_command, "generate": generate_command, "eval": eval_command,
            "checkpoints": checkpoints_command}


if __name__ == "__main__":
    sys.exit(main())
