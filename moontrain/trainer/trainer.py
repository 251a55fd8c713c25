"""The trainer: builds model, parallelism, optimizer and data from a RunConfig; train_step reads top to bottom.

Gradient scaling: each rank's loss is the mean over its own tokens, so the global loss is the mean of
the per-rank losses. FSDP's reduce-scatter averages dense grads over the world. An expert's grad on
its owner already sums the contributions of every rank of its EP group (the backend's backward sums
them: the reversed all-to-all, or moonep's combine-backward plus reduce_grad); the backends accumulate
it times ExpertsContext.loss_scale = 1 / world size (set in moontrain.parallel.parallelize only), and summing
over the expert-data-parallel replicas gives the same mean.

Metrics are accumulated on device (MetricsWindow) and read once per logging step; fit takes a step's host
reads (the verdict, moontrain.trainer.guard, and the metrics) in the next step, once that step's backward is
queued, so the GPU does not wait for the host at step boundaries. Checkpoints
(moontrain.checkpoint) hold the whole train state: model, optimizer, schedule, step, tokens seen, RNG,
data position and the wandb run id; fit() saves them as checkpoint.every (steps), checkpoint.every_minutes
(time since the job's start or its last save, agreed over the ranks with the step's verdict) and
save_final say.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from moontrain.checkpoint import load_checkpoint, save_checkpoint
from moontrain.checkpoint.state import TrainState
from moontrain.config.run_config import RunConfig
from moontrain.data.loader import build_loader
from moontrain.data.tokenizer import tokenizer_record
from moontrain.metrics.flops import flops_per_token, peak_flops
from moontrain.metrics.heatmap import ExpertLoad, colorize, heatmap_path, write_png
from moontrain.metrics.host_read import HostRead
from moontrain.metrics.moe_stats import MoEStats
from moontrain.metrics.progress import ProgressLog, StepStats
from moontrain.metrics.window import MetricsWindow, WindowRead, memory_stats
from moontrain.model.kda.layer import uses_fla
from moontrain.model.router_updates import MeanFreeRouterUpdates
from moontrain.model.transformer import K3Model
from moontrain.optim.adamw import build_optimizer
from moontrain.optim.qk_clip import QKClip
from moontrain.parallel.clip import clip_grad_norm_global
from moontrain.parallel.fsdp import allreduce_dense_grads
from moontrain.parallel.layout import ParallelLayout
from moontrain.parallel.parallelize import parallelize
from moontrain.trainer.determinism import enable_determinism
from moontrain.trainer.evaluate import Evaluator
from moontrain.trainer.first_step import FirstStepClock
from moontrain.trainer.guard import DivergenceGuard, StepVerdict, launch_verdict
from moontrain.trainer.preempt import PreemptionHandler
from moontrain.trainer.recompute import recomputed_layers


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _in_state(name: str) -> property:
    """The trainer's attribute `name`, stored in its TrainState."""
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value))


class Trainer:
    def __init__(self, cfg: RunConfig, layout: ParallelLayout, *, log: ProgressLog | None = None) -> None:
        cfg.check_world(layout.world_size)
        self.cfg, self.layout, self.log = cfg, layout, log
        device = layout.device
        if cfg.train.deterministic:
            enable_determinism(device, kda_fla=uses_fla(cfg.model, cfg.kernels.kda, device))
        self.compute_dtype = resolve_compute_dtype(cfg.parallel.compute_dtype, device)
        self.data = build_loader(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
                                 global_batch=cfg.train.global_batch_size, rank=layout.rank,
                                 world_size=layout.world_size, device=device)
        self.model = K3Model(cfg.model, kernels=cfg.kernels, placement=layout.expert_placement,
                             # packed documents: attention and the KDA state stop at each EOS
                             document_eos_id=self.data.eos_id if cfg.model.document_mask else None,
                             deterministic_attention=cfg.train.deterministic, device=device)
        self.model.init_weights(cfg.train.seed)
        micro_batch = cfg.train.micro_batch(layout.world_size)
        self.accumulation_steps = cfg.train.accumulation_steps(layout.world_size)
        self.recomputed = recomputed_layers(cfg, layout, self.compute_dtype.itemsize)
        # recompute, compile, FSDP / plain dense, the experts' backends: in that order (moontrain.parallel.parallelize)
        parallel = parallelize(self.model, layout, parallel=cfg.parallel, experts=cfg.experts,
                               compute_dtype=self.compute_dtype, max_tokens=micro_batch * cfg.train.seq_len,
                               recomputed=self.recomputed, compile_dense=cfg.train.compile)
        self.fsdp, self.plain_dense = parallel.fsdp, parallel.plain_dense
        self.experts_ctx, self.experts_runtime = parallel.experts_ctx, parallel.experts_runtime
        self.experts = [moe.experts for moe in self.model.moe_layers()]
        self.expert_params = [p for w in self.experts for p in w.master.values()]
        expert_ids = {id(p) for p in self.expert_params}
        self.dense_params = [p for p in self.model.parameters() if id(p) not in expert_ids]
        write_back_targets = [(master, w.compute[name], not w.defers_zero)
                              for w in self.experts for name, master in w.master.items()]
        schedule_steps = cfg.optim.schedule_steps or cfg.train.steps
        optimizer, scheduler = build_optimizer(self.model, cfg.optim, schedule_steps, expert_group=layout.edp_group,
                                               write_back_targets=write_back_targets,
                                               dense_write_back_targets=(self.plain_dense.write_back_targets()
                                                                         if self.plain_dense is not None else ()),
                                               shard_expert_state=cfg.parallel.shard_expert_state)
        mla_ids = [i for i, block in enumerate(self.model.layers) if not block.is_kda]  # QK-Clip: softmax layers
        self.qk_clip = (QKClip([self.model.layers[i].attn for i in mla_ids], cfg.optim.qk_clip_tau,
                               group=layout.world_group, layer_ids=mla_ids)
                        if cfg.optim.qk_clip_tau > 0 else None)
        # what checkpoints save and restore; optimizer, scheduler, step, tokens_seen and wandb_run_id are
        # read and set through it (a replaced optimizer is the one checkpoints see)
        self.state = TrainState(layout=layout, model=self.model, optimizer=optimizer, scheduler=scheduler,
                                data=self.data, experts=self.experts, model_config=cfg.model, optim_config=cfg.optim,
                                experts_backend=cfg.experts.backend, data_source=cfg.data.source,
                                schedule_steps=schedule_steps, tokenizer=self._tokenizer_record(),
                                seeds={"train.seed": cfg.train.seed, "data.seed": cfg.data.seed})
        self.last_saved_step: int | None = None
        self.guard = DivergenceGuard(cfg.train.max_skipped_steps)
        self._deferred: list[_VerdictRead | _LogRead] = []  # host reads of earlier steps, in launch order
        self._device_wait_s = 0.0  # the host's waits for the device in those reads since the last log
        self.preemption: PreemptionHandler | None = None  # set by the worker (signal handlers, main thread)
        self.first_step: FirstStepClock | None = None  # set by the worker (rank 0 of a GPU job): the wait, said
        self.stop_requested = False  # agreed over the ranks after each step
        self.save_due = False  # checkpoint.every_minutes passed on some rank: agreed like stop_requested
        self.last_save_time = time.monotonic()  # the job's start, then each save's end
        self.last_checkpoint: Path | None = None
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = peak_flops(device)
        self.router_updates = MeanFreeRouterUpdates(
            [moe.router for moe in self.model.moe_layers() if moe.router.mean_free_updates],
            layout.world_group if layout.distributed else None)
        self.moe_stats = MoEStats(self.model.moe_layers(), ep=layout.ep)
        moe_ids = [i for i, block in enumerate(self.model.layers) if block.is_moe]
        self.window = MetricsWindow(moe_ids, layout)
        self.evaluator = (Evaluator(cfg.eval, cfg.train, cfg.data, self.model, layout, self.reshard_dense)
                          if cfg.eval.every else None)

    def _tokenizer_record(self) -> dict | None:
        tokenizer = self.data.source.tokenizer
        return tokenizer_record(self.cfg.data.tokenizer, tokenizer) if tokenizer is not None else None

    # kept in the TrainState (what checkpoints save and restore), read and set through the trainer
    optimizer = _in_state("optimizer")
    scheduler = _in_state("scheduler")
    step = _in_state("step")
    tokens_seen = _in_state("tokens_seen")
    wandb_run_id = _in_state("wandb_run_id")  # set by the worker (rank 0)

    def train_step(self) -> StepStats | None:
        """One optimizer step; returns the logged stats on a logging step (its host reads taken before it
        returns), else None."""
        ready = self._train_step(defer=False)
        return ready[-1] if ready else None

    def run_steps(self, n: int) -> list[StepStats]:
        """n steps pipelined as fit runs them (each step's host reads taken in the next, so the device is not
        left idle at step boundaries), every read taken before it returns; the logged stats in step order."""
        ready = []
        for _ in range(n):
            ready += self._train_step(defer=True)
        return ready + self._take_deferred()

    def _train_step(self, defer: bool) -> list[StepStats]:
        """One optimizer step. defer: leave this step's host reads (verdict, metrics window) to the next
        step, which takes them once its own backward is queued (moontrain.metrics.host_read); returns the
        stats whose reads were taken in this call, in step order."""
        tokens_BT, targets_BT = self.data.batch(self.step)
        host_BT = self.data.host_tokens  # the documents' bounds for fla come from these: no host sync
        n = self.accumulation_steps
        if n == 1:
            loss, ce = self.model(tokens_BT, targets_BT, host_tokens_BT=host_BT)
            loss.backward()
            self._accumulate_dense_grads()
        else:  # gradient accumulation: equal micro-batches, each loss weighted 1/n (the step's mean)
            ce = torch.zeros((), device=self.layout.device)
            for i, (tok_bT, tgt_bT, host_bT) in enumerate(zip(tokens_BT.chunk(n), targets_BT.chunk(n),
                                                              host_BT.chunk(n), strict=True)):
                if self.fsdp:  # FSDP reduce-scatters the dense grads once, after the last pass
                    self.model.set_requires_gradient_sync(i == n - 1)
                    if not self.cfg.parallel.fsdp_reshard_after_forward:  # and gathers once, in the first
                        self.model.set_reshard_after_backward(i == n - 1)
                loss, ce_i = self.model(tok_bT, tgt_bT, host_tokens_BT=host_bT)
                (loss / n).backward()
                self._accumulate_dense_grads()
                ce += ce_i.detach() / n
                # the graph (and what its nodes keep, e.g. moonep's plans) goes now, not after the next
                # pass's forward: that would hold two passes' plans at once
                del loss, ce_i
        self._reduce_grads()
        grad_norm = clip_grad_norm_global(self.dense_params, self.expert_params, self.layout,
                                          self.cfg.optim.grad_clip, optimizer=self.optimizer,
                                          experts_sharded=self.cfg.parallel.shard_expert_state)
        ready = self._take_deferred()  # the earlier steps' reads: done on the device by now
        lr = self.scheduler.get_last_lr()[0]
        written, applied = self._optimizer_step(grad_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for w in self.experts:
            w.finish_step(written)
        counts_LE = self._balance_routers(applied)
        self.window.add(ce, grad_norm, self.moe_stats.step(counts_LE))
        self.step += 1
        self.tokens_seen += self.cfg.train.global_batch_size * self.cfg.train.seq_len
        if self.step % self.cfg.train.log_every == 0 or self.step == self.cfg.train.steps:
            self._deferred.append(self._launch_log(lr))
        if not defer or self.qk_clip is not None:  # QK-Clip's statistics are read at the log
            ready += self._take_deferred()
        return ready

    def _optimizer_step(self, grad_norm: torch.Tensor) -> tuple[frozenset[int], torch.Tensor | bool]:
        """The update unless the step's verdict (moontrain.trainer.guard) finds it non-finite. Returns the ids
        of the masters the optimizer wrote back (TrainOptimizer.written_back; empty for a skipped step) and
        whether the update applied: the step's 0/1 float32 device flag when the optimizer skips on the
        device, else the host's answer.
        An optimizer that skips on the device is stepped at once and the verdict read later (_take_deferred);
        any other reads it first (one host read)."""
        requested = self.preemption is not None and self.preemption.requested
        interval_s = self.cfg.checkpoint.every_minutes * 60
        save_due = bool(interval_s) and time.monotonic() - self.last_save_time >= interval_s
        verdict_3 = launch_verdict(grad_norm, requested, self.layout, save_due)
        if self.optimizer.skips_on_device and self.qk_clip is None:
            applied = verdict_3[0]
            self.optimizer.skip_next_step_if(1.0 - applied)
            with self.router_updates.held():  # expert popularity moves through the router bias only
                self.optimizer.step()
                self._dense_copies_written()  # before held() moves the router rows (cast again, then)
            self._deferred.append(_VerdictRead(self.step, HostRead(verdict_3)))
            return self.optimizer.written_back, applied
        if not self._apply_verdict(self.step, StepVerdict.of(verdict_3.tolist())):
            return frozenset(), False
        with self.router_updates.held():
            self.optimizer.step()
            self._dense_copies_written()
        if self.qk_clip is not None:  # after the copies' versions were taken: its changes are cast again
            self.qk_clip.step()
        return self.optimizer.written_back, True

    def _dense_copies_written(self) -> None:
        """parallel.dense=plain: the compute copies the optimizer just wrote back are current (the next forward
        casts only masters changed after this point: the mean-free router rows, QK-Clip's weights)."""
        if self.plain_dense is not None:
            self.plain_dense.finish_step(self.optimizer.written_back)

    def _apply_verdict(self, step: int, verdict: StepVerdict) -> bool:
        """The verdict of step `step` (0-based) on the host: the guard counts it (raises DivergenceError after
        too many skips in a row), the stop and save requests are taken; True: the update applies."""
        self.stop_requested = self.stop_requested or verdict.stop
        # a save the step asked for is done when a checkpoint was written since (a deferred verdict)
        self.save_due = self.save_due or (verdict.save and (self.last_saved_step or 0) <= step)
        return self.guard.admit(verdict.finite, step)

    def _take_deferred(self) -> list[StepStats]:
        """Take every deferred host read in launch order: verdicts to the guard, metric windows to the log."""
        ready = []
        while self._deferred:
            record = self._deferred.pop(0)
            if isinstance(record, _VerdictRead):
                self._apply_verdict(record.step, StepVerdict.of(record.host.read()))
                self._device_wait_s += record.host.waited_s
            else:
                ready.append(self._finish_log(record))
        return ready

    def fit(self) -> list[StepStats]:
        """Train to train.steps, saving checkpoints as configured; returns the logged stats. Steps are
        pipelined: a step's host reads are taken in the next step, once its backward is queued, so the
        device is not left idle at step boundaries (the first step of the job is read at once: its clock
        ends in its read). Console and metrics lines therefore come one step late."""
        ckpt = self.cfg.checkpoint
        logged = []
        self.window.restart_clock()
        self.last_save_time = time.monotonic()  # checkpoint.every_minutes counts training time
        while self.step < self.cfg.train.steps:
            logged += self._train_step(defer=self.first_step is None)
            if self.first_step is not None:
                print(f"moontrain: {self.first_step.line()}", flush=True)
                self.first_step = None
            if (ckpt.every and self.step % ckpt.every == 0) or self.save_due:
                logged += self._take_deferred()  # the saved step's verdict first (it may stop the run)
                self.save_checkpoint()
            if self.stop_requested:  # preemption: every rank saw the same verdict
                logged += self._take_deferred()
                if self.layout.rank == 0:
                    print(f"moontrain: stopping after step {self.step} as asked"
                          + ("" if self.last_saved_step == self.step else ": saving a checkpoint"), flush=True)
                if self.last_saved_step != self.step:
                    self.save_checkpoint()
                return logged
        logged += self._take_deferred()
        if ckpt.save_final and self.last_saved_step != self.step:
            self.save_checkpoint()
        return logged

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.cfg.checkpoint.dir or Path(self.cfg.train.run_dir) / "checkpoints")

    def save_checkpoint(self, root: str | Path | None = None) -> Path:
        """Collective: the whole train state as <checkpoint dir>/step_<step> (see moontrain.checkpoint)."""
        if self._deferred:
            raise RuntimeError("save_checkpoint with host reads still deferred: Trainer.fit takes them first "
                               "(_take_deferred)")
        t0 = time.perf_counter()
        path = save_checkpoint(self.state, root if root is not None else self.checkpoint_dir,
                               keep_last=self.cfg.checkpoint.keep_last)
        self.last_saved_step, self.last_checkpoint = self.step, path
        self.save_due = False
        self.window.exclude(time.perf_counter() - t0)  # tokens/s counts training time only
        self.last_save_time = time.monotonic()
        return path

    def load_checkpoint(self, path: str | Path, *, verified: bool = False) -> dict:
        """Collective-free: restore model, optimizer, schedule, step, RNG and data position from `path`;
        returns the checkpoint's train state. verified: its file digests were checked (resume.resolve_resume)."""
        self.reshard_dense()  # a gathered copy would outlive the load
        for moe in self.model.moe_layers():  # what a forward before the load counted is not the loaded run's
            moe.router.reset_step_statistics()
        state = load_checkpoint(self.state, path, verified=verified)
        if self.plain_dense is not None:
            self.plain_dense.invalidate()  # the next forward casts the loaded masters
        self.last_saved_step, self.last_checkpoint = self.step, Path(path)
        return state

    def _launch_log(self, lr: float) -> _LogRead:
        """Collective: reduce the window's metrics on the device (one all_reduce) for _finish_log; what the
        host knows now (data waits, memory) is taken now, the expert counts of a heatmap step are set aside,
        and an evaluation that is due runs now (on this step's weights; its time leaves the window)."""
        heatmap = self._heatmap_due(self.step) and self.moe_stats.load is not None
        return _LogRead(window=self.window.launch(), step=self.step, lr=lr, tokens_seen=self.tokens_seen,
                        host_scalars={**memory_stats(self.layout.device), **self.data.take_metrics()},
                        expert_load=self.moe_stats.load.launch() if heatmap else None,
                        evals=self._evaluate_if_due())

    def _finish_log(self, record: _LogRead) -> StepStats:
        """Read a launched log (waits for its values only) and report it."""
        values = self.window.read(record.window)
        n, dt = values.pop("window_steps"), values.pop("window_s")
        wait_ms, self._device_wait_s = 1e3 * (self._device_wait_s + record.window.host.waited_s) / n, 0.0
        tokens_per_s = n * self.cfg.train.global_batch_size * self.cfg.train.seq_len / dt
        mfu = (tokens_per_s / self.layout.world_size * self.flops_per_token / self.peak_flops
               if self.peak_flops else None)
        stats = StepStats(step=record.step, loss=values.pop("loss"), lr=record.lr, grad_norm=values.pop("grad_norm"),
                          tokens_per_s=tokens_per_s, step_time_s=dt / n,
                          max_maxvio=values.get("moe/expert_maxvio/max", 0.0), mfu=mfu,
                          peak_mem_gib=record.host_scalars.get("mem/peak_gib"),
                          scalars={**values, **(self.qk_clip.flush() if self.qk_clip is not None else {}),
                                   "tokens_seen": float(record.tokens_seen), "skipped_steps": float(self.guard.total),
                                   "time/device_wait_ms": wait_ms, **record.host_scalars, **record.evals})
        if self.log is not None:
            self.log.log(stats)
        if record.expert_load is not None:
            share_LE = ExpertLoad.share(record.expert_load)
            if self.log is not None:
                path = write_png(heatmap_path(self.cfg.train.run_dir, record.step), colorize(share_LE))
                self.log.image("moe/expert_load", path, record.step)
        return stats

    def _heatmap_due(self, step: int) -> bool:
        """Every metrics.heatmap_every logging steps (and the last): the expert-load PNG (rank 0) and wandb image."""
        every, logs = self.cfg.metrics.heatmap_every, step // self.cfg.train.log_every
        return bool(every) and (logs % every == 0 or step == self.cfg.train.steps)

    def _evaluate_if_due(self) -> dict[str, float]:
        """Collective: the held-out loss on evaluation steps (moontrain.trainer.evaluate), else nothing."""
        if self.evaluator is None or not self.evaluator.due(self.step):
            return {}
        values = self.evaluator.run()
        self.window.exclude(values["eval/time_s"])  # tokens/s counts training time only
        return values

    def close(self) -> None:
        """Release backend-owned memory (moonep's symmetric heap) and stop the data thread. The model is
        unusable afterwards."""
        self.data.close()
        self.experts_runtime.close()

    def reshard_dense(self) -> None:
        """Drop FSDP's gathered dense parameters (parallel.dense=plain: register the fp32 masters again). With
        parallel.fsdp_reshard_after_forward=false a forward without backward (evaluation, calibration) leaves
        the blocks gathered, and the next forward would reuse them: call this after such a forward when the
        sharded parameters change before the next one (load_checkpoint does)."""
        if self.plain_dense is not None:
            self.plain_dense.reshard()
        if self.fsdp:
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _accumulate_dense_grads(self) -> None:
        """parallel.dense=plain: this pass's compute-dtype dense grads into fp32 (FSDP accumulates in its hooks)."""
        if self.plain_dense is not None:
            self.plain_dense.accumulate_grads()

    def _reduce_grads(self) -> None:
        layout = self.layout
        self.experts_runtime.finish_backward()  # moonep's last reduce_grad may still be queued
        if self.plain_dense is not None:  # the fp32 masters back on the model, with their accumulated grads
            self.plain_dense.reshard()
        if layout.distributed and self.cfg.parallel.dense == "allreduce":
            allreduce_dense_grads(self.model, layout.world_group)
        for w in self.experts:
            w.reduce_grads(layout.edp_group)
            w.attach_grads()

    @torch.no_grad()
    def _balance_routers(self, applied: torch.Tensor | bool) -> torch.Tensor:
        """Reduce this step's expert counts over the world, update every router bias unless the step was
        skipped (a skipped step changes no trained state; `applied` as _optimizer_step returns it: a device
        flag gates the update on the device); returns counts_LE."""
        routers = [moe.router for moe in self.model.moe_layers()]
        if not routers:
            return torch.zeros(0, self.cfg.model.num_experts, dtype=torch.long, device=self.layout.device)
        counts_LE = torch.stack([r.tokens_per_expert_E for r in routers])
        if self.layout.distributed:
            dist.all_reduce(counts_LE, group=self.layout.world_group)
        if applied is False:
            return counts_LE
        for router, counts_E in zip(routers, counts_LE, strict=True):
            if applied is True:
                router.update_bias(counts_E)
            else:
                router.update_bias(counts_E, gate=applied)
        return counts_LE


@dataclass(frozen=True, slots=True)
class _VerdictRead:
    """A step's verdict (moontrain.trainer.guard.launch_verdict) on its way to the host."""
    step: int  # 0-based, as DivergenceGuard.admit takes it
    host: HostRead


@dataclass(frozen=True, slots=True)
class _LogRead:
    """A logging step's metrics window on its way to the host, with what the host knew at that step."""
    window: WindowRead
    step: int
    lr: float
    tokens_seen: int
    host_scalars: dict[str, float]
    expert_load: HostRead | None  # a heatmap step's counts (ExpertLoad.launch)
    evals: dict[str, float]  # an evaluation step's held-out loss, taken at the step
