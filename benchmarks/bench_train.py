"""End-to-end training over routing skew, moonep vs all-to-all.

    torchrun --nproc_per_node=2 benchmarks/bench_train.py --recipe recipes/k3_small.yaml
    torchrun --nproc_per_node=2 benchmarks/bench_train.py --recipe recipes/k3_tiny.yaml --steps 3 --warmup 1 \\
        --targets 0.2 1                                         # CPU smoke check (gloo)
    python benchmarks/bench_train.py --show benchmarks/results/bench_train_R2_<tag>.json   # table, no GPU

Trailing `key=value` arguments are recipe overrides (a smaller variant: model.num_layers=8 ...).
k3_small has E=64, K=8, so its largest maxvio is E/K - 1 = 7: targets 10 and 20 both run at 6.79. A
variant that reaches 20 with the same expert parameter count (less expert compute per token):
model.num_experts=192 model.moe_intermediate_size=320 (reachable 23; 96*1024*320*2 bytes per projection
and rank is a multiple of 2 MiB, as the GPU heap needs).

Skew: the router's forced skew (Router.set_skew, moontrain/model/router.py: a fixed log-normal expert
popularity with spread sigma, seeded identically on every rank). Per target maxvio, sigma is bisected on a
log scale against the realised expert-level maxvio of the routed counts of --calib-batches forward
passes at the initial weights (counts reduced over the world, max over MoE layers: the statistic the
trainer logs as "max maxvio"). The largest reachable maxvio is E/K - 1 (the K most popular experts
take every token); a target beyond 0.97 of it runs at 0.97 of it (as bench_comm does), and a target
below the unskewed router's own imbalance runs at sigma = 0. The realised maxvio is always reported,
at calibration and as the median over the timed steps. An untrained router is itself far from
balanced (maxvio ~1 at init on k3_tiny), so before calibrating, the routers' score-correction biases are
pre-balanced at the initial weights (what a trained model's aux-loss-free bias does; --no-prebalance
skips it) and copied into every point's trainer; the bias update itself is off
(model.router_bias_update_rate=0) so the skew stays put (--keep-balancing leaves it on).

Placement: what slows the all-to-all backend is the load of the hottest *rank*, and with the skew's
own numbering (--placement random, docs/moonep.md §9's convention) the popular experts of k3_small (E=64) spread
over both ranks: at an expert maxvio of 4.7 the rank load is only 1.05 x the mean. --placement
concentrated (default) renumbers the popularity so that expert 0 is the most popular, expert 1 the next,
...: the popular experts share home rank 0, the case expert parallelism has to survive (rank load up to
R x the mean). The table's "rank" column is the rank-level maxvio (rows per rank; 0 with moonep after
planning), so either choice is visible in the result.

Learning rate: the points measure cost, not learning (--learning-row adds one that learns, below). At the recipe's learning rate the routing
of a fresh model drifts within a few steps (k3_tiny, target 0.2: 0.22 at step 0, 1.3 at step 3), so the
target would not hold. --lr (default 1e-10) sets optim.lr so small that the fp32 weights do not move
while every op of a training step still runs (forward, backward, gradient reductions, clipping, AdamW,
master push); --lr recipe keeps the recipe's schedule. --learning-row runs one more point at the recipe's
learning rate with the router balancing on, on text (recipes/data/learning), and reports its step time
beside its first and last loss and realised maxvio: a speed figure always comes with a model that learns
(`--targets --learning-row`, no target value: the learning row alone, a speed row that learns).
--diagnose-learning gives that point the diagnostics of the first target too (--profile, --host-profile,
--sync-debug, --memory-trace; files named ..._text.txt): what text with documents costs beside synthetic tokens.

Per (backend, target) point a fresh Trainer (the same seed, so the same initial weights) trains
--warmup + --steps optimizer steps through Trainer.train_step, ranks aligned before each step (a step's
time includes the trainer's per-step metric flush: log_every=1, one small all_reduce and host read).
Reported: median step time over the timed steps (each step's time is the max over ranks), tokens/s per
GPU, MFU from the trainer's own FLOPs per token (moontrain.metrics.flops) against 989 TFLOP/s dense
bf16 and against a torch.mm rate measured in this run (compute dtype: bf16 on GPU, fp32 on CPU), peak
allocated / reserved memory (max over ranks; also the spread of the per-step peak over the timed
steps), allocator retries during the point, moonep's symmetric heap (outside torch's allocator), and
whether the point ran out of memory. On CPU the GPU-only columns are left empty.

Steady state (--window N): the per-step timing above syncs the device, aligns the ranks and reads the
stats on the host around every step, so each step starts with an empty GPU queue (the CPU's launch
latency of the step's first kernels is idle GPU time, ~8 ms per k3_small_moe step on 2xH200). After the
timed steps, N more run back to back as Trainer.fit runs them (Trainer.run_steps: each step's host reads
taken in the next step; log_every > 1; one sync at the end); their mean step time and MFU are the "steady"
columns, the figure a throughput-based MFU quotes.

Out of memory: torch.OutOfMemoryError is caught per point, recorded, and the run continues with the
next point once every rank has reported (over a gloo side group). An OOM that hits one rank only, while
its peer waits inside a collective, cannot be recovered in-process: the peer stays blocked until the
process-group timeout (--timeout-s) ends the job. The JSON is rewritten after every point, so the
points measured so far survive; backends run in --backends order, targets in --targets order.
Writes benchmarks/results/bench_train_R<R>_<tag>.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_train_table import learning_row, merge_rounds, print_table, row
from benchmarks.diagnostics.train_diagnostics import (
    count_syncs,
    host_profile,
    memory_trace,
    profile_step,
    start_memory_history,
)
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.config.loader import to_dict
from moontrain.metrics.balance import maxvio_L
from moontrain.metrics.flops import PEAK_BF16_FLOPS
from moontrain.metrics.window import memory_stats
from moontrain.model.experts.moonep_backend import MoonEPRuntime
from moontrain.parallel.layout import ParallelLayout, build_layout
from moontrain.trainer.trainer import Trainer, resolve_compute_dtype
from moontrain.trainer.worker import select_device

PEAK_DENSE_BF16 = PEAK_BF16_FLOPS["H200"]  # 989 TFLOP/s, the H100/H200 SXM datasheet number
GIB = 2**30


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one large square torch.mm in `dtype` (median of timed runs after warm-up)."""
    n, iters = (8192, 20) if device.type == "cuda" else (1024, 5)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(3 + iters):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce(x: float, op: dist.ReduceOp, layout: ParallelLayout) -> float:
    t = torch.tensor(float(x), dtype=torch.float64, device=layout.device)
    dist.all_reduce(t, op=op, group=layout.world_group)
    return float(t)


# ---------------------------------------------------------------- calibration


@torch.no_grad()
def apply_skew(trainer: Trainer, sigma: float, placement: str) -> None:
    """Set every router's forced skew; placement "concentrated" renumbers the popularity so that expert 0
    is the most popular, expert 1 the next, ... (the popular experts share home rank 0)."""
    for moe in trainer.model.moe_layers():
        moe.router.set_skew(sigma)
        if placement == "concentrated":
            moe.router.skew_bias_E.copy_(moe.router.skew_bias_E.sort(descending=True).values)


@torch.no_grad()
def routed_counts(trainer: Trainer, sigma: float, batches: list, placement: str) -> torch.Tensor:
    """Collective: [L, E] tokens routed to each expert of each MoE layer by forward passes over `batches`
    (the first batches the points train on) at skew sigma, reduced over the world."""
    routers = [moe.router for moe in trainer.model.moe_layers()]
    apply_skew(trainer, sigma, placement)
    for r in routers:
        r.tokens_per_expert_E.zero_()
    n = trainer.accumulation_steps  # the model takes micro-batches (moonep's buffer holds one)
    for tokens_BT, targets_BT in batches:
        for tok_bT, tgt_bT in zip(tokens_BT.chunk(n), targets_BT.chunk(n), strict=True):
            trainer.model(tok_bT, tgt_bT)
    counts_LE = torch.stack([r.tokens_per_expert_E for r in routers])
    dist.all_reduce(counts_LE, group=trainer.layout.world_group)
    for r in routers:
        r.tokens_per_expert_E.zero_()
    return counts_LE


def realised_maxvio(trainer: Trainer, sigma: float, batches: list, placement: str) -> float:
    """Collective: expert-level maxvio at skew sigma, max over MoE layers (the trainer's "max maxvio")."""
    return float(maxvio_L(routed_counts(trainer, sigma, batches, placement)).max())


@torch.no_grad()
def prebalance(trainer: Trainer, batches: list, args: argparse.Namespace) -> tuple[torch.Tensor, float, float]:
    """Score-correction biases [L, E] that balance the unskewed router at the initial weights.

    An untrained router is far from balanced (maxvio ~1 at init), and a trained one is balanced by its
    aux-loss-free bias; this emulates the latter so that low targets (0.2) are reachable. Per layer:
    bias += rate * (mean - count) / mean, kept when that layer's maxvio improves (rate * 1.5), undone
    otherwise (rate / 2). Returns (biases, maxvio before, maxvio after)."""
    routers = [moe.router for moe in trainer.model.moe_layers()]
    bias_LE = torch.stack([r.score_bias_E for r in routers]).clone()
    counts_LE = routed_counts(trainer, 0.0, batches, args.placement)
    best_L = maxvio_L(counts_LE)
    before = float(best_L.max())
    best_bias_LE = bias_LE.clone()
    rate_L = torch.full_like(best_L, args.prebalance_rate)
    for _ in range(args.prebalance_iters):
        c = counts_LE.double()
        mean = c.mean(1, keepdim=True)
        bias_LE = best_bias_LE + (rate_L[:, None] * (mean - c) / mean).to(bias_LE.dtype)
        for r, b in zip(routers, bias_LE, strict=True):
            r.score_bias_E.copy_(b)
        counts_LE = routed_counts(trainer, 0.0, batches, args.placement)
        v_L = maxvio_L(counts_LE)
        better = v_L < best_L
        best_L = torch.where(better, v_L, best_L)
        best_bias_LE[better] = bias_LE[better]
        rate_L = torch.where(better, rate_L * 1.5, rate_L * 0.5)
    for r, b in zip(routers, best_bias_LE, strict=True):
        r.score_bias_E.copy_(b)
    return best_bias_LE, before, float(best_L.max())


def set_router_biases(trainer: Trainer, bias_LE: torch.Tensor | None) -> None:
    if bias_LE is None:
        return
    with torch.no_grad():
        for moe, b in zip(trainer.model.moe_layers(), bias_LE, strict=True):
            moe.router.score_bias_E.copy_(b)


def calibrate(trainer: Trainer, batches: list, target: float, args: argparse.Namespace) -> dict:
    """Bisect log(sigma) until the realised maxvio is within args.calib_tol (relative) of the target."""
    cfg = trainer.cfg.model
    reach = cfg.num_experts / cfg.num_experts_per_tok - 1
    goal = min(target, 0.97 * reach)
    floor = realised_maxvio(trainer, 0.0, batches, args.placement)
    out = {"target_maxvio": target, "goal_maxvio": goal, "reachable_maxvio": reach, "unskewed_maxvio": floor}
    if goal <= floor:
        return {**out, "sigma": 0.0, "calib_maxvio": floor, "calib_evals": 1}
    lo, hi = math.log(1e-5), math.log(100.0)
    best = (math.inf, 0.0, floor)
    evals = 1
    for _ in range(args.calib_iters):
        mid = (lo + hi) / 2
        got = realised_maxvio(trainer, math.exp(mid), batches, args.placement)
        evals += 1
        best = min(best, (abs(got - goal), math.exp(mid), got))
        if abs(got - goal) <= args.calib_tol * goal:
            break
        lo, hi = (mid, hi) if got < goal else (lo, mid)
    return {**out, "sigma": best[1], "calib_maxvio": best[2], "calib_evals": evals}


# ---------------------------------------------------------------- one point


def run_point(cfg: RunConfig, layout: ParallelLayout, args: argparse.Namespace, side: dist.ProcessGroup,
              mm_flops: float, bias_LE: torch.Tensor | None, sigma: float, learning: bool = False) -> dict:
    """One (backend, skew sigma) point: a fresh trainer of `cfg`, its routers skewed by `sigma`; learning: the
    --learning-row point."""
    device = layout.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    retries0 = memory_stats(device).get("mem/alloc_retries", 0.0)
    step_s, step_peak, step_resv, maxvio, rank_maxvio, losses = [], [], [], [], [], []
    step_req: list[float] = []  # peak of the bytes tensors asked for (no allocator rounding)
    redundant: list[float] = []
    data_wait: list[float] = []  # seconds the step waited for its batch (the loader's prefetch thread)
    oom_where, heap_bytes, flops_per_token, pooled, syncs, trace_peak = None, 0, None, 0, None, None
    recomputed: list[int] | None = None
    window_s = window_wait_s = None
    trainer = None
    # the same answer on every rank (collectives follow); the learning row when --diagnose-learning
    diagnosed = at_diagnosed_point(args, cfg, sigma) or (learning and args.diagnose_learning)
    traced = args.memory_trace and diagnosed and device.type == "cuda"
    if traced:
        start_memory_history()  # call sites of what the trainer keeps between steps (slows this point)
    try:
        trainer = Trainer(cfg, layout)
        set_router_biases(trainer, bias_LE)
        apply_skew(trainer, sigma, args.placement)
        flops_per_token = trainer.flops_per_token
        recomputed = list(trainer.recomputed)  # train.activation_checkpointing as the trainer resolved it
        buf = trainer.experts_runtime.buffer if isinstance(trainer.experts_runtime, MoonEPRuntime) else None
        heap_bytes = buf.heap.local_bytes if buf is not None else 0
        for _ in range(args.warmup + args.steps):
            _sync(device)
            dist.barrier(group=layout.world_group)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            stats = trainer.train_step()  # log_every=1: every step returns its stats (one host read)
            _sync(device)
            step_s.append(time.perf_counter() - t0)
            if device.type == "cuda":  # the peaks were reset before this step
                step_peak.append(torch.cuda.max_memory_allocated(device) / GIB)
                step_resv.append(torch.cuda.max_memory_reserved(device) / GIB)
                # -1: an allocator without the statistic (e.g. backend:cudaMallocAsync)
                step_req.append(float(torch.cuda.memory_stats(device).get("requested_bytes.all.peak", -1)))
            maxvio.append(stats.max_maxvio)
            rank_maxvio.append(stats.scalars.get("moe/rank_maxvio/max", float("nan")))
            redundant.append(stats.scalars.get("moe/redundant_experts/total", 0.0))
            losses.append(stats.loss)
            data_wait.append(stats.scalars.get("data/wait_ms", float("nan")) / 1e3)
        if args.window:  # steady state: no sync, barrier or host read between the window's steps
            trainer.cfg.train.log_every = 1 << 30
            trainer.data.take_metrics()  # the window's data wait accumulates from here
            _sync(device)
            dist.barrier(group=layout.world_group)
            t0 = time.perf_counter()
            trainer.run_steps(args.window)  # pipelined as Trainer.fit runs its steps
            _sync(device)
            window_s = time.perf_counter() - t0
            window_wait_s = trainer.data.take_metrics()["data/wait_ms"] / 1e3  # mean per step of the window
            trainer.cfg.train.log_every = 1  # the diagnostics below read a step's stats
        pooled = buf.pooled_plans if buf is not None else 0
        if args.sync_debug and device.type == "cuda" and (
                (learning and args.diagnose_learning) or (sigma == args.sync_skew and args.current_round == 0
                                                          and ("syncs", cfg.experts.backend) not in args.diagnosed)):
            args.diagnosed.add(("syncs", cfg.experts.backend))  # once per backend (and the learning row)
            syncs = count_syncs(trainer, layout, args, cfg, side)  # one extra, untimed step
        if diagnosed and wants_profile(args, cfg) and device.type == "cuda":  # three extra, untimed steps, profiled
            profile_step(trainer, layout, args, cfg, side)
        if diagnosed and args.host_profile:  # two extra, untimed steps under cProfile
            host_profile(trainer, layout, args, side)
        if traced:
            trace_peak = memory_trace(trainer, layout, args, cfg, side)  # one extra, untimed step
    except torch.OutOfMemoryError as err:
        oom_where = f"step {len(step_s)}" if trainer is not None else "building the trainer"
        print(f"rank {layout.rank}: out of memory at {oom_where}: {str(err).splitlines()[0]}", flush=True)
    # every rank learns whether any rank ran out of memory (gloo: works while the device is in trouble)
    flag = torch.tensor([0.0 if oom_where is None else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side)
    oom = bool(flag.item())
    mem = memory_stats(device)
    if trainer is not None:
        trainer.close()
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    timed = args.warmup + args.steps
    n_done = torch.tensor([len(step_s)], dtype=torch.float64)
    dist.all_reduce(n_done, op=dist.ReduceOp.MIN, group=side)
    point: dict = {"oom": oom, "oom_rank_where": oom_where, "steps_done": int(n_done.item())}
    if oom or int(n_done.item()) < timed:
        return point
    # per-step time: max over ranks; per-step peak: max over ranks
    cuda = device.type == "cuda"
    per_step = torch.tensor([step_s, step_peak, step_resv, step_req] if cuda else [step_s], dtype=torch.float64,
                            device=device)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX, group=layout.world_group)
    step_max = per_step[0].tolist()
    peak_max, resv_max = (per_step[1].tolist(), per_step[2].tolist()) if cuda else ([], [])
    req_max = [int(v) for v in per_step[3].tolist()] if cuda else []  # exact: float64 holds these integers
    has_req = cuda and min(req_max) >= 0
    med = statistics.median(step_max[args.warmup:])
    tok_per_gpu = cfg.train.global_batch_size * cfg.train.seq_len / layout.world_size / med
    steady = _reduce(window_s, dist.ReduceOp.MAX, layout) / args.window if window_s is not None else None
    steady_tok = cfg.train.global_batch_size * cfg.train.seq_len / layout.world_size / steady if steady else None
    point.update(
        step_time_s=med,
        step_times_s=step_max,
        tokens_per_s_per_gpu=tok_per_gpu,
        model_flops_per_token=flops_per_token,
        mfu_989=tok_per_gpu * flops_per_token / PEAK_DENSE_BF16 if cuda else None,
        mfu_mm=tok_per_gpu * flops_per_token / mm_flops,
        steady_window_steps=args.window or None,
        steady_step_time_s=steady,
        steady_tokens_per_s_per_gpu=steady_tok,
        steady_mfu_989=steady_tok * flops_per_token / PEAK_DENSE_BF16 if cuda and steady_tok else None,
        # data wait per step: max over ranks; its median over the timed steps, and over the steady window
        data_wait_ms_median=1e3 * statistics.median(
            _reduce(w, dist.ReduceOp.MAX, layout) for w in data_wait[args.warmup:]),
        steady_data_wait_ms=(1e3 * _reduce(window_wait_s, dist.ReduceOp.MAX, layout)
                             if window_wait_s is not None else None),
        maxvio_median=statistics.median(maxvio[args.warmup:]),
        maxvio_steps=maxvio,
        rank_maxvio_median=statistics.median(rank_maxvio[args.warmup:]),
        redundant_experts_median=statistics.median(redundant[args.warmup:]),  # over layers (and ranks' slots)
        pooled_plans=int(_reduce(float(pooled), dist.ReduceOp.MAX, layout)),  # moonep's plan pool at the end
        host_syncs=syncs,
        memory_trace_peak_bytes=(int(_reduce(float(trace_peak or 0), dist.ReduceOp.MAX, layout))
                                 if traced else None),
        loss_first_last=[losses[0], losses[-1]],
        peak_allocated_gib=max(peak_max) if cuda else None,
        peak_allocated_bytes=int(max(peak_max) * GIB) if cuda else None,  # exact: GiB floats of whole bytes
        peak_reserved_gib=max(resv_max) if cuda else None,
        step_peak_allocated_gib=[min(peak_max[args.warmup:]), max(peak_max[args.warmup:])] if cuda else None,
        # requested = the sizes tensors asked for; allocated adds the caching allocator's rounding (a
        # block not worth splitting is handed out whole), which depends on what the process allocated
        # before: each point builds its trainer after the previous point's
        peak_requested_bytes=max(req_max) if has_req else None,
        step_peak_requested_bytes=[min(req_max[args.warmup:]), max(req_max[args.warmup:])] if has_req else None,
        alloc_retries=int(_reduce(mem["mem/alloc_retries"] - retries0, dist.ReduceOp.MAX, layout)) if cuda else None,
        symmetric_heap_gib=_reduce(heap_bytes / GIB, dist.ReduceOp.MAX, layout),
        recomputed_layers=recomputed,
    )
    return point


def at_diagnosed_point(args: argparse.Namespace, cfg: RunConfig, sigma: float) -> bool:
    """The --profile-at points (default: the first target), in the first round, once per (backend,
    skew): targets below the unskewed router's own imbalance all run at skew 0."""
    key = (cfg.experts.backend, sigma)
    if sigma not in args.profile_skews or args.current_round != 0 or key in args.diagnosed:
        return False
    args.diagnosed.add(key)
    return True


def wants_profile(args: argparse.Namespace, cfg: RunConfig) -> bool:
    """--profile [BACKEND ...]: (at a diagnosed point) every named backend, all when none is named."""
    return args.profile is not None and (not args.profile or cfg.experts.backend in args.profile)




# ---------------------------------------------------------------- driver


def build_config(args: argparse.Namespace, run_dir: str, **extra: object) -> RunConfig:
    overrides = [*args.overrides, f"train.steps={args.warmup + args.steps}", "train.log_every=1",
                 f"train.run_dir={run_dir}", "checkpoint.save_final=false", "checkpoint.every=0",
                 "checkpoint.resume=none", "metrics.wandb=false"]
    if not args.keep_balancing:
        overrides.append("model.router_bias_update_rate=0.0")
    if args.lr != "recipe":
        overrides.append(f"optim.lr={float(args.lr)!r}")
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return from_dict(RunConfig, load_recipe(args.recipe, overrides))


def build_learning_config(args: argparse.Namespace, run_dir: str) -> RunConfig:
    """The --learning-row point: the recipe's own learning rate and router-bias update, no skew, on text
    (recipes/data/learning: its corpus, with its BPE tokenizer or, for small vocabularies, bytes)."""
    folder = Path(__file__).resolve().parents[1] / "recipes/data/learning"
    tokenizer = "bytes" if args.learning_tokenizer == "bytes" else str(folder / "tokenizer")
    overrides = [*args.overrides, "data.source=dataset", f"data.path={folder / 'corpus.jsonl'}",
                 f"data.tokenizer={tokenizer}", f"train.steps={args.warmup + args.steps}", "train.log_every=1",
                 f"train.run_dir={run_dir}", "checkpoint.save_final=false", "checkpoint.every=0",
                 "checkpoint.resume=none", "metrics.wandb=false"]
    return from_dict(RunConfig, load_recipe(args.recipe, overrides))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/k3_small.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. model.num_layers=8")
    p.add_argument("--backends", nargs="+", default=["moonep", "alltoall"], choices=["moonep", "alltoall"])
    p.add_argument("--targets", type=float, nargs="*", default=[0.2, 1.0, 10.0, 20.0],
                   help="target maxvio; none (--targets with no value) with --learning-row: the learning row alone")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per point")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per point, before the timed ones")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every point this many times, interleaved (round 1: all points, round 2: all points, "
                        "...); a point reports the median over all its rounds' timed steps")
    p.add_argument("--window", type=int, default=0,
                   help="after the timed steps, time this many more back to back (no per-step sync, barrier or "
                        "host read: steady-state training) and report their mean step time and MFU too; 0: off")
    p.add_argument("--calib-batches", type=int, default=2, help="forward passes per calibration evaluation")
    p.add_argument("--calib-iters", type=int, default=16, help="bisection steps per target at most")
    p.add_argument("--calib-tol", type=float, default=0.03, help="relative tolerance on the realised maxvio")
    p.add_argument("--no-prebalance", action="store_true",
                   help="keep the untrained router's own imbalance (no score-bias pre-balancing)")
    p.add_argument("--prebalance-iters", type=int, default=24, help="pre-balancing steps")
    p.add_argument("--prebalance-rate", type=float, default=0.01, help="first pre-balancing step size")
    p.add_argument("--placement", default="concentrated", choices=["concentrated", "random"],
                   help="where the popular experts live (see the module docstring)")
    p.add_argument("--lr", default="1e-10", help="optim.lr for the points (default: weights stay put), or 'recipe'")
    p.add_argument("--keep-balancing", action="store_true", help="keep the router's aux-loss-free bias update on")
    p.add_argument("--learning-row", action="store_true",
                   help="after the points, one more at the recipe's learning rate with the router balancing on, on "
                        "text (recipes/data/learning), so the speed rows come with a model that learns: its step "
                        "time, maxvio and first/last loss")
    p.add_argument("--learning-tokenizer", choices=["bpe", "bytes"], default="bpe",
                   help="the learning row's tokenizer: the corpus's BPE (30,922 ids) or bytes (small vocabularies)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="process-group timeout: a peer stuck in a collective (e.g. after the other rank ran out of "
                        "memory) fails then; a step takes well under a second")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file tag (default: the recipe name, the device type and the date)")
    p.add_argument("--profile", nargs="*", choices=["moonep", "alltoall"], default=None, metavar="BACKEND",
                   help="profile three extra steps at the first target of these backends (none named: all; GPU; "
                        "the GPU's timeline of two steps as Trainer.fit runs them, then a step's kernel tables and "
                        "call sites, to --out)")
    p.add_argument("--profile-at", type=float, nargs="+", default=None, metavar="MAXVIO",
                   help="targets (of --targets) for --profile and --memory-trace (default: the first)")
    p.add_argument("--memory-trace", action="store_true",
                   help="at the --profile-at points: the allocations live at the start and at the peak of one extra "
                        "step, per rank (benchmarks/diagnostics/train_diagnostics.py; GPU). Records allocation call sites from "
                        "the trainer's construction on, which slows those points: use it in a run of its own")
    p.add_argument("--diagnose-learning", action="store_true",
                   help="--profile, --sync-debug and --memory-trace at the --learning-row point too (files named "
                        "..._text.txt): what text with documents costs beside the first target's synthetic tokens")
    p.add_argument("--host-profile", action="store_true",
                   help="at the --profile-at points (and the learning row with --diagnose-learning): two more "
                        "pipelined steps under cProfile, the host's Python functions by self and cumulative time "
                        "(host_profile_<backend>_skew<s>.txt); CPU too")
    p.add_argument("--sync-debug", action="store_true",
                   help="count the host synchronisations of one extra step at the first target (GPU)")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved result and exit (no GPU needed)")
    args = p.parse_args()
    if not args.targets and not args.learning_row:
        p.error("--targets with no value runs no cost point: add --learning-row (the learning row alone)")
    unknown = [t for t in (args.profile_at or []) if t not in args.targets]
    if unknown:
        p.error(f"--profile-at {unknown} are not among --targets {args.targets}")
    if args.show:
        print_table(json.loads(Path(args.show).read_text()))
        return
    device, backend = select_device()
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    side = dist.new_group(backend="gloo", timeout=timeout)
    try:
        run(args, device, side)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device, side: dist.ProcessGroup) -> None:
    run_dir = tempfile.mkdtemp(prefix="bench_train_") if dist.get_rank() == 0 else ""
    names = [run_dir]
    dist.broadcast_object_list(names, src=0, group=side)
    run_dir = names[0]
    cfg0 = build_config(args, run_dir, **{"experts.backend": args.backends[0]})
    layout = build_layout(cfg0.parallel.ep, device)
    cfg0.check_world(layout.world_size)
    is_main = layout.rank == 0
    R = layout.world_size
    dtype = resolve_compute_dtype(cfg0.parallel.compute_dtype, device)
    mm_flops = _reduce(measure_matmul_flops(device, dtype), dist.ReduceOp.MIN, layout)
    tag = args.tag or f"{Path(args.recipe).stem}_{device.type}_{time.strftime('%Y%m%d')}"
    path = Path(args.out) / f"bench_train_R{R}_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"recipe": args.recipe, "overrides": args.overrides, "world_size": R, "ep": cfg0.parallel.ep,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "keep_balancing": args.keep_balancing,
            "prebalance": not args.no_prebalance, "lr": args.lr, "placement": args.placement,
            "tokens_per_step": cfg0.train.global_batch_size * cfg0.train.seq_len,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "compute_dtype": str(dtype), "matmul_flops": mm_flops,
            "peak_dense_bf16_flops": PEAK_DENSE_BF16, "model": to_dict(cfg0.model)}
    if is_main:
        print(f"bench_train: {layout.describe()}; device {meta['device']}; torch.mm {dtype} "
              f"{mm_flops / 1e12:.2f} TFLOP/s", flush=True)

    # calibration: sigma per target at the initial weights (routing does not depend on the backend)
    t0 = time.perf_counter()
    trainer = Trainer(cfg0, layout) if args.targets else None  # no cost point: nothing to calibrate
    batches = [trainer.data.batch(i) for i in range(args.calib_batches)] if trainer else []  # a stream
    bias_LE = None
    if trainer is not None and not args.no_prebalance:
        bias_LE, before, after = prebalance(trainer, batches, args)
        meta["prebalance_maxvio"] = [before, after]
        if is_main:
            print(f"pre-balanced the routers' score-correction biases: unskewed maxvio {before:.3f} -> {after:.3f}",
                  flush=True)
    calib = []
    for target in args.targets:
        c = calibrate(trainer, batches, target, args)
        calib.append(c)
        if is_main:
            print(f"calibrated target maxvio {target:g}: sigma {c['sigma']:.4g} -> realised {c['calib_maxvio']:.3f} "
                  f"(unskewed {c['unskewed_maxvio']:.3f}, reachable {c['reachable_maxvio']:.2f}, "
                  f"{c['calib_evals']} evals)", flush=True)
    if trainer is not None:
        trainer.close()
    del trainer
    meta["calibration_s"] = time.perf_counter() - t0
    at = args.profile_at if args.profile_at is not None else args.targets[:1]
    args.profile_skews = [c["sigma"] for t, c in zip(args.targets, calib, strict=True) if t in at]  # --profile
    args.sync_skew = calib[0]["sigma"] if calib else None  # --sync-debug: the first target
    args.diagnosed = set()  # (backend, skew) points already diagnosed

    raw: list[dict] = []  # one point per (round, backend, target)
    for rnd in range(args.rounds):
        args.current_round = rnd  # --profile / --sync-debug: the first round only
        for backend in args.backends:
            for c in calib:
                t0 = time.perf_counter()
                cfg = build_config(args, run_dir, **{"experts.backend": backend})
                point = {"backend": backend, **c, **run_point(cfg, layout, args, side, mm_flops, bias_LE, c["sigma"])}
                point["wall_s"] = time.perf_counter() - t0
                point["round"] = rnd
                raw.append(point)
                if is_main:
                    print(row(point), f"[round {rnd + 1}/{args.rounds}, {point['wall_s']:.0f} s]", flush=True)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    result = {"config": meta, "points": merge_rounds(raw, args.warmup)}
                    if args.rounds > 1:
                        result["rounds"] = raw
                    path.write_text(json.dumps(result, indent=1))
    result = {"config": meta, "points": merge_rounds(raw, args.warmup)}
    if args.learning_row:  # the same step at the recipe's learning rate, on text, the routers balancing
        cfg = build_learning_config(args, run_dir)
        point = {"backend": cfg.experts.backend, "lr": cfg.optim.lr, "data": cfg.data.path,
                 **run_point(cfg, layout, args, side, mm_flops, None, 0.0, learning=True)}
        result["learning"] = point
        if is_main:
            print(learning_row(point), flush=True)
    if is_main:
        if args.rounds > 1:
            result["rounds"] = raw
        path.write_text(json.dumps(result, indent=1))
        print_table(result)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
