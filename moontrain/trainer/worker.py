"""Per-rank entry point started by torchrun: `python -m moontrain.trainer.worker RECIPE [key=value ...]`.

Picks nccl on GPU and gloo on CPU (on the launcher's loopback store under a single-host `moontrain launch`,
moontrain.parallel.job_store), builds the layout, takes the run directory's lock (rank 0, for every rank:
moontrain.trainer.run_lock), resumes from the latest good checkpoint unless checkpoint.resume says otherwise
(moontrain.checkpoint.resume, decided once for all ranks; a fresh run takes the initial weights of
checkpoint.init_from when set), writes the resolved config (rank 0, once the resume is settled), opens the
wandb run (rank 0; the id comes from the checkpoint on resume, so the same run continues), trains and prints
the end-of-run summary. Resuming names what changed since the checkpoint (optim settings, the LR schedule's
span); a run that uses fla on CUDA seeds Triton's cache with fla's shipped tile choices on every rank
(trainer.kernel_cache) and, on a cold cache, waits before its first step for the shipped Triton kernels compiled
in parallel processes (trainer.warmup_pool: the launcher's, else started here while the trainer is built;
MOONTRAIN_RECORD_KERNELS=<path> records a job's own, trainer.kernel_warmup); a GPU job says what
its first step compiles before it starts and how long it took after (trainer.first_step); known-harmless library
warnings are filtered (trainer.quiet).

Faults: the process group fails a collective after parallel.timeout_s; heartbeats (parallel.heartbeat)
name a dead or frozen rank in every survivor's error; SIGTERM / SIGINT finish the step, save and exit 0
(trainer.preempt); the rank dies with torchrun. User errors (settings, data, checkpoints, divergence)
are one line `moontrain: rank R: error: ...` (trainer.errors); anything else keeps its traceback, printed
before the line. Under `moontrain launch` the first such line goes to the file named by
MOONTRAIN_ERROR_FILE instead, which the launcher prints last, in place of torchrun's report.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from moontrain.checkpoint import init_weights_from
from moontrain.checkpoint.resume import START_OVER, set_aside_earlier_run
from moontrain.checkpoint.resume import resolve_resume as resolve_checkpoint
from moontrain.checkpoint.store import incomplete_after, optim_changes
from moontrain.checkpoint.tensors import CheckpointError
from moontrain.config import RunConfig, dump_config, from_dict, load_recipe
from moontrain.config.loader import to_dict
from moontrain.metrics.progress import ProgressLog
from moontrain.metrics.wandb_run import WandbRun
from moontrain.model.kda.layer import kda_fallback_warning, uses_fla
from moontrain.optim.schedule import lr_multiplier
from moontrain.parallel.heartbeat import Heartbeat
from moontrain.parallel.hosts import check_ep_group_hosts
from moontrain.parallel.job_store import worker_store
from moontrain.parallel.layout import ParallelLayout, build_layout
from moontrain.planning.preflight import gpu_memory_warning
from moontrain.supervisor import die_with_parent
from moontrain.trainer.determinism import set_cublas_workspace
from moontrain.trainer.errors import one_line
from moontrain.trainer.first_step import FirstStepClock, first_step_note
from moontrain.trainer.kernel_cache import seed_shipped_fla
from moontrain.trainer.kernel_warmup import KernelRecorder
from moontrain.trainer.out_of_memory import TrainingOutOfMemory, out_of_memory_line
from moontrain.trainer.preempt import PreemptionHandler
from moontrain.trainer.quiet import silence_known_warnings
from moontrain.trainer.run_lock import RunLock
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.warmup_pool import rank_warmup


def select_device() -> tuple[torch.device, str]:
    """This torchrun rank's device and process-group backend: its GPU and nccl, else the CPU and gloo
    (with the cores split between the local ranks)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return torch.device("cpu"), "gloo"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m moontrain.trainer.worker RECIPE [key=value ...] (started by torchrun)")
    rank = int(os.environ.get("RANK", "0"))
    silence_known_warnings()
    try:
        cfg = from_dict(RunConfig, load_recipe(argv[0], argv[1:]))
    except ValueError as err:
        _exit_one_line(rank, f"error: {err}")
    die_with_parent()  # torchrun gone (killed with the launcher): no rank keeps training
    preemption = PreemptionHandler(rank)
    if cfg.train.deterministic:
        set_cublas_workspace()  # read when CUDA initialises
    device, backend = select_device()
    store = worker_store(cfg.parallel.timeout_s)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=cfg.parallel.timeout_s), store=store,
                            rank=rank if store is not None else -1,
                            world_size=int(os.environ["WORLD_SIZE"]) if store is not None else -1)
    heartbeat = None
    if dist.get_world_size() > 1 and cfg.parallel.heartbeat_timeout_s > 0:
        heartbeat = Heartbeat(_default_store(), dist.get_rank(), dist.get_world_size(),
                              timeout_s=cfg.parallel.heartbeat_timeout_s,
                              report=lambda line: _report_line(rank, line)).start()
    try:
        _train(cfg, device, preemption)
    except Exception as err:
        line = one_line(err, cfg.data)
        culprit = heartbeat.diagnose() if heartbeat is not None and line is None else None
        if line is None:
            traceback.print_exc()
            line = f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        _exit_one_line(rank, line + (f"; {culprit}" if culprit else ""))
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        preemption.uninstall()
        dist.destroy_process_group()


def _exit_one_line(rank: int, line: str) -> NoReturn:
    _report_line(rank, line)
    sys.exit(1)


def _report_line(rank: int, line: str) -> None:
    """Print the rank's one line, or hand it to the launcher through MOONTRAIN_ERROR_FILE (the first rank to
    fail wins and the launcher prints its line last; the others' lines are printed as they come)."""
    text = f"moontrain: rank {rank}: {line}".replace("\n", " ")
    path = os.environ.get("MOONTRAIN_ERROR_FILE")
    if path:
        try:
            with open(path, "x") as fh:
                fh.write(text + "\n")
            return
        except FileExistsError:
            pass
    print(text, file=sys.stderr, flush=True)


def _default_store() -> dist.Store:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _train(cfg: RunConfig, device: torch.device, preemption: PreemptionHandler) -> None:
    layout = build_layout(cfg.parallel.ep, device, cfg.parallel.ep_hosts)
    cfg.check_world(layout.world_size)
    moonep_group = layout.ep_host_group if layout.ep_host_group is not None else layout.ep_group
    check_ep_group_hosts(moonep_group, cfg.experts.backend)
    is_main = layout.rank == 0
    lock = RunLock(Path(cfg.train.run_dir)) if is_main else None
    _agree(lock.acquire() if lock is not None else None, layout)
    try:
        _train_locked(cfg, device, preemption, layout)
    finally:
        if lock is not None:
            lock.release()


def _agree(problem: str | None, layout: ParallelLayout) -> None:
    """Rank 0's verdict, raised as a ValueError on every rank alike (None: go on)."""
    if layout.distributed:
        box = [problem]
        dist.broadcast_object_list(box, src=0, group=layout.world_group)
        problem = box[0]
    if problem is not None:
        raise ValueError(problem)


def _train_locked(cfg: RunConfig, device: torch.device, preemption: PreemptionHandler,
                  layout: ParallelLayout) -> None:
    is_main = layout.rank == 0
    config_path = Path(cfg.train.run_dir) / "config.yaml"  # written once the resume is settled
    # before any KDA kernel runs; on every rank, as ranks on several hosts have a cache each
    fla_seed = (seed_shipped_fla(device) if device.type == "cuda" and uses_fla(cfg.model, cfg.kernels.kda, device)
                else None)
    # Triton kernels compiling in other processes (the launcher's, else started here) while the trainer is built;
    # joined before the first step
    warmup = rank_warmup(cfg.train.kernel_warmup, cfg.train.kernel_warmup_workers, device)
    if warmup is not None and (line := warmup.start()) and is_main:
        print(f"moontrain: {line}", flush=True)
    record_to = os.environ.get("MOONTRAIN_RECORD_KERNELS") if is_main and device.type == "cuda" else None
    recorder = KernelRecorder().__enter__() if record_to else None
    if is_main:
        print(f"moontrain: {layout.describe(cfg.parallel.dense_at(layout.world_size, layout.distributed))}; experts backend {cfg.experts.backend}; device {device}"
              + ("; deterministic kernels" if cfg.train.deterministic else ""), flush=True)
        print(f"moontrain: config: {config_path} (the recipe with its overrides, resolved)", flush=True)
        if (warning := kda_fallback_warning(cfg.model, cfg.kernels.kda, device)) is not None:
            print(f"moontrain: {warning}", flush=True)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            warning = gpu_memory_warning(cfg, layout.world_size, f"this GPU ({props.name})", props.total_memory)
            if warning is not None:
                print(f"moontrain: warning: {warning}", flush=True)
    try:
        trainer = Trainer(cfg, layout)
    except BaseException:
        if warmup is not None:
            warmup.close()
        raise
    trainer.preemption = preemption
    sink = None
    try:
        resume_from, passed_over = resolve_resume(cfg, trainer.checkpoint_dir, layout)
        if resume_from is not None:
            try:
                state = trainer.load_checkpoint(resume_from, verified=True)
            except CheckpointError as err:
                raise CheckpointError(f"{err}; {START_OVER}") from err
            notes = passed_over + resume_notes(cfg, trainer.checkpoint_dir, resume_from, state)
            if is_main:
                dump_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
                print(f"moontrain: resumed from {resume_from} at step {trainer.step}", flush=True)
                for note in notes:
                    print(f"moontrain: {note}", flush=True)
        else:
            if is_main:
                for note in passed_over:
                    print(f"moontrain: {note}", flush=True)
            if is_main and cfg.checkpoint.resume == "none":
                moved = set_aside_earlier_run(trainer.checkpoint_dir, Path(cfg.train.run_dir))
                if moved is not None:
                    print(f"moontrain: checkpoint.resume=none: starting over; the earlier run's checkpoints are "
                          f"in {moved}", flush=True)
            if is_main:
                dump_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
            if cfg.checkpoint.init_from is not None:
                init_weights_from(trainer.state, cfg.checkpoint.init_from)
                if is_main:
                    print(f"moontrain: initial weights from {cfg.checkpoint.init_from}", flush=True)
        if is_main:
            if cfg.metrics.wandb:
                sink = WandbRun(cfg.metrics, run_dir=cfg.train.run_dir, config=to_dict(cfg),
                                run_id=trainer.wandb_run_id)
                trainer.wandb_run_id = sink.id
            trainer.log = ProgressLog(cfg.train.run_dir, cfg.train.steps, sink=sink, start_step=trainer.step)
            if sink is not None and trainer.step:  # what a killed job logged but did not flush to wandb
                sink.backfill(trainer.log.kept, cfg.train.run_dir)
        if warmup is not None and (line := warmup.wait()) and is_main:
            print(f"moontrain: {line}", flush=True)
        if layout.distributed:  # a host's other ranks find the kernels its first rank warmed, not compile them too
            dist.barrier(group=layout.world_group)
        note = first_step_note(cfg, device, fla_seed, warmed=warmup is not None and warmup.ran)
        if is_main and note and trainer.step < cfg.train.steps:
            print(f"moontrain: {note}", flush=True)
            trainer.first_step = FirstStepClock(fla_seed)
        try:
            trainer.fit()
        except torch.OutOfMemoryError as err:
            gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
            raise TrainingOutOfMemory(out_of_memory_line(cfg, layout.world_size, trainer.compute_dtype.itemsize,
                                                         trainer.recomputed, trainer.step + 1, err, gpu_bytes)) from err
        if trainer.log is not None:
            console = Path(cfg.train.run_dir) / "console.log"
            print(trainer.log.summary(step=trainer.step, tokens_seen=trainer.tokens_seen,
                                      checkpoint=trainer.last_checkpoint,
                                      wandb_dir=sink.sync_dir if sink is not None else None,
                                      files=[config_path, *([console] if console.is_file() else [])]), flush=True)
        if trainer.stop_requested and is_main:
            print(f"moontrain: stopped by {preemption.signal_name or 'a signal to another rank'} after step "
                  f"{trainer.step} of {cfg.train.steps}; checkpoint saved in {trainer.checkpoint_dir}; continue "
                  "with checkpoint.resume=auto", flush=True)
    finally:
        if warmup is not None:  # stops its processes where a job failed before its first step
            warmup.close()
        if trainer.log is not None:
            trainer.log.close()
        trainer.close()
        if recorder is not None:
            recorder.__exit__(None, None, None)
            major, minor = torch.cuda.get_device_capability(device)
            manifest = recorder.manifest(f"sm{major}{minor}", {"recipe": cfg.train.run_dir,
                                                              "gpu": torch.cuda.get_device_name(device)})
            Path(record_to).write_text(manifest.to_json())
            print(f"moontrain: {len(manifest.kernels)} Triton kernels recorded in {record_to}", flush=True)


def resume_notes(cfg: RunConfig, checkpoint_dir: Path, resumed: Path, state: dict) -> list[str]:
    """What a resume changes or passes over, one line each; raises when the run has nothing left to do
    below the checkpoint's step."""
    step = state["step"]
    if step > cfg.train.steps:
        raise ValueError(f"checkpoint {resumed} is at step {step}, past train.steps={cfg.train.steps}: raise "
                         f"train.steps above {step} to train on, or set checkpoint.resume=none to start afresh")
    notes = []
    if cfg.checkpoint.resume == "auto":
        notes += [f"resume: auto passed over {p} (incomplete: an interrupted save or missing files)"
                  for p in incomplete_after(checkpoint_dir, resumed)]
    seeds = {"train.seed": cfg.train.seed, "data.seed": cfg.data.seed}
    changed = [f"{k}={now} (the checkpoint's is {state['seeds'][k]})" for k, now in seeds.items()
               if k in state.get("seeds", {}) and state["seeds"][k] != now]
    if changed and cfg.checkpoint.resume == "auto":
        raise ValueError(f"{', '.join(changed)}: a relaunch continues the run in {cfg.train.run_dir} with the seeds it "
                         "started with; relaunch with the checkpoint's, or start over with checkpoint.resume=none, or "
                         "use another train.run_dir")
    if changed:
        notes.append(f"seeds differ from the checkpoint's, which fixed the weights and data order so far: "
                     f"{', '.join(changed)}")
    changes = optim_changes(state, cfg.optim)
    if changes:
        notes.append("optim settings differ from the checkpoint's; the recipe's apply from here: " + ", ".join(changes))
    span = schedule_change(state, cfg) if step < cfg.train.steps else None
    if span:
        notes.append(span)
    if step == cfg.train.steps:
        notes.append(f"checkpoint is at train.steps={cfg.train.steps} already: nothing to train")
    return notes


def schedule_change(state: dict, cfg: RunConfig) -> str | None:
    """The note when the LR schedule's span differs from the checkpoint's (train.steps changed on relaunch):
    the lr it moves, and the other choice, optim.schedule_steps (checkpoints older than the record: None)."""
    saved = state.get("schedule_steps")
    now = cfg.optim.schedule_steps or cfg.train.steps
    if saved is None or saved == now:
        return None
    step, lr = state["step"], cfg.optim.lr
    before, after = lr * lr_multiplier(step, cfg.optim, saved), lr * lr_multiplier(step, cfg.optim, now)
    note = (f"the LR schedule spanned {saved} steps and now spans {now}; it continues as configured: lr at step "
            f"{step} {before:.3e} -> {after:.3e}")
    if cfg.optim.schedule_steps is None:
        note += (f" (it follows train.steps={cfg.train.steps}); to keep the old decay and run the steps past {saved} "
                 f"at its final lr, set optim.schedule_steps={saved}")
    return note


def resolve_resume(cfg: RunConfig, checkpoint_dir: Path, layout: ParallelLayout | None = None
                   ) -> tuple[Path | None, list[str]]:
    """checkpoint.resume: auto -> the latest checkpoint whose files pass verification (None if there is none),
    and a line for each newer one passed over for a bad file; none -> None; otherwise the named directory,
    which must exist and pass. Collective over the layout's ranks (moontrain.checkpoint.resume)."""
    return resolve_checkpoint(cfg.checkpoint, checkpoint_dir, layout)


if __name__ == "__main__":
    main()
