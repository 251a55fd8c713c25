"""One-step diagnostics of benchmarks/bench_train.py (GPU): a profile, the host synchronisations, and
the allocations live at the step's memory peak. Each runs one extra, untimed training step; every
rank takes part, and rank 0 writes one text file to --out with every rank's part.
"""

from __future__ import annotations

import argparse
import collections
import re
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from moontrain.config import RunConfig
from moontrain.parallel.layout import ParallelLayout
from moontrain.trainer.trainer import Trainer

OUR_CODE = ("/moontrain/", "/moonep/", "/benchmarks/")


def _align(layout: ParallelLayout) -> None:
    torch.cuda.synchronize(layout.device)
    dist.barrier(group=layout.world_group)


def _write_all_ranks(text: str, name: str, args: argparse.Namespace, side: dist.ProcessGroup,
                     layout: ParallelLayout) -> None:
    """Gather every rank's text (gloo side group) and write them, rank by rank, on rank 0."""
    parts: list = [None] * layout.world_size
    dist.all_gather_object(parts, text, group=side)
    if layout.rank == 0:
        path = Path(args.out) / name
        path.write_text("".join(f"===== rank {r}\n{t}\n" for r, t in enumerate(parts)))
        print(f"written: {path}", flush=True)


def _point_name(kind: str, trainer: Trainer) -> str:
    skew = max((moe.router.skew for moe in trainer.model.moe_layers()), default=0.0)  # bench_train's skew
    text = "_text" if trainer.cfg.data.source == "dataset" else ""  # bench_train's --diagnose-learning row
    return f"{kind}_{trainer.cfg.experts.backend}_skew{skew:.3g}{text}.txt"


def profile_step(trainer: Trainer, layout: ParallelLayout, args: argparse.Namespace, cfg: RunConfig,
                 side: dist.ProcessGroup) -> None:
    """Profile three more steps. The first two record GPU activity alone (no host events: they run as they do
    unprofiled, pipelined as Trainer.fit runs them, Trainer.run_steps), for their timeline: where the GPU
    waits for the host. The third records the host too, with
    shapes and Python stacks (which slow the host several times over, so its idle time is not the step's):
    per rank the ops by CUDA time (top 40), then the ops by self CUDA time split by input shapes (top 60),
    which tells apart the call sites of one op, then the Python call sites of the copies and adds
    (STACKED_OPS) by self CUDA time, then the call sites that launch the most GPU work (_launch_sites: where
    the launch-bound stretches' kernels, memsets and copies come from)."""
    from torch.profiler import ProfilerActivity, profile

    _align(layout)
    with profile(activities=[ProfilerActivity.CUDA]) as light:
        trainer.run_steps(2)
        torch.cuda.synchronize(layout.device)
    try:
        light_timeline = timeline_summary(_gpu_kernels(light))
    except Exception as err:
        light_timeline = f"no timeline: {err!r}\n"
    _align(layout)
    # verbose: without it this torch records empty Python stacks (checked on 2.13)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True,
                 experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) as prof:
        trainer.train_step()
        torch.cuda.synchronize(layout.device)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=50, max_shapes_column_width=90)
    try:  # a diagnostic: a surprise in the profiler's event format must not end the benchmark
        kernels = _gpu_kernels(prof)
        timeline, every_kernel = timeline_summary(kernels), kernel_table(kernels)
    except Exception as err:
        timeline, every_kernel = f"no timeline: {err!r}\n", ""
    try:
        stacks = _op_stacks(prof) + "\n" + _launch_sites(prof)
    except Exception as err:
        stacks = f"no call stacks: {err!r}\n"
    _write_all_ranks(f"two steps as Trainer.fit runs them (GPU activity alone), {light_timeline}\n"
                     f"step profiled with host events, shapes and stacks, {timeline}\n{table}\n\n"
                     f"by input shapes (self CUDA time):\n{shapes}\n\n{every_kernel}\n{stacks}",
                     _point_name("profile", trainer), args, side, layout)


# eager ops whose call sites the profile lists: elementwise passes with no home in the op table
STACKED_OPS = ("aten::copy_", "aten::add", "aten::add_", "aten::clone", "aten::mul", "aten::_to_copy")


def host_profile(trainer: Trainer, layout: ParallelLayout, args: argparse.Namespace, side: dist.ProcessGroup,
                 steps: int = 2) -> str:
    """The host's Python time over `steps` more steps, pipelined as Trainer.fit runs them (Trainer.run_steps),
    under cProfile (which slows the host, so the shares, not the times, are the step's): the functions with the
    most self time and the most cumulative time, with the steps' wall time and the host's waits for the device
    beside them. Written per rank (host_profile_<backend>_skew<s>.txt); returns this rank's text."""
    import cProfile
    import io
    import pstats
    import time

    if layout.device.type == "cuda":
        torch.cuda.synchronize(layout.device)
    dist.barrier(group=layout.world_group)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    trainer.run_steps(steps)
    prof.disable()
    if layout.device.type == "cuda":
        torch.cuda.synchronize(layout.device)
    wall = time.perf_counter() - t0
    out = io.StringIO()
    out.write(f"{steps} pipelined steps under cProfile: {wall * 1e3 / steps:.1f} ms a step (wall, profiled)\n")
    for key, title in (("tottime", "self"), ("cumulative", "cumulative")):
        out.write(f"\nby {title} time:\n")
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(40)
    text = out.getvalue()
    _write_all_ranks(text, _point_name("host_profile", trainer), args, side, layout)
    return text


def _op_stacks(prof, top: int = 30, frames: int = 6) -> str:
    """STACKED_OPS grouped by their innermost Python frames: count, self CUDA ms and the frames."""
    rows = [e for e in prof.key_averages(group_by_stack_n=frames) if e.key in STACKED_OPS]
    rows.sort(key=lambda e: -e.self_device_time_total)
    out = [f"call sites of {', '.join(STACKED_OPS)} (self CUDA ms, count, innermost {frames} frames):"]
    for e in rows[:top]:
        out.append(f"  {e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}  {e.key}")
        out.extend(f"        {frame}" for frame in e.stack[:frames])
    return "\n".join(out) + "\n"


def _launch_sites(prof, top: int = 40, frames: int = 4) -> str:
    """The aten ops with GPU work of their own (kernels, memsets, copies), grouped by their innermost Python
    frames and sorted by calls: each call is at least one launch, and a step whose GPU idles between short
    kernels is bound by their number, not their time."""
    rows = [e for e in prof.key_averages(group_by_stack_n=frames)
            if e.key.startswith("aten::") and e.self_device_time_total > 0]
    rows.sort(key=lambda e: (-e.count, -e.self_device_time_total))
    total = sum(e.count for e in rows)
    out = [f"call sites by launches: aten ops with self GPU time, {total} calls in all (count, self CUDA ms, "
           f"innermost {frames} frames):"]
    for e in rows[:top]:
        out.append(f"  {e.count:6d} {e.self_device_time_total / 1e3:9.2f} ms  {e.key}")
        out.extend(f"        {frame}" for frame in e.stack[:frames])
    return "\n".join(out) + "\n"


def _gpu_kernels(prof) -> list[tuple[int, int, int, str]]:
    """(stream, start ns, duration ns, name) of every GPU activity (kernels, copies, memsets) profiled;
    not the GPU-side ranges of record_function annotations (they span kernels)."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if (e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
                and not e.is_user_annotation()):
            out.append((e.device_resource_id(), e.start_ns(), e.duration_ns(), e.name()))
    return out


# kernel classes of the timeline, first match wins (names of cuBLAS/CUTLASS, cuDNN, NCCL, Triton, ATen)
KERNEL_CLASSES = (
    ("nccl", r"nccl"),
    ("attention", r"fmha|flash|sdpa|attention|^triton_tem_"),  # inductor templates here: flex_attention
    ("kda (fla)", r"kda|delta_rule|wy_repr|recompute_w_u|chunk_fwd_kernel_o|chunk_bwd_kernel|l2norm|"
                  r"chunk_local_cumsum|kkt|solve_tril|merge_16x16|inverse_kernel"),
    ("inductor fused", r"^triton_(poi|red|per)_"),  # torch.compile's generated kernels (names may say _to_copy)
    ("moonep comm", r"_scatter_kernel|_expand_kernel|_push_kernel|_chain_list_kernel|_reduce_kernel|_barrier_kernel|"
                    r"_signal|_wait_kernel|plan|_prefix|_histogram"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|wgmma|_grouped_mm|splitK"),
    ("optimizer", r"adam|multi_tensor_apply"),
    ("copy / cast", r"[Mm]emcpy|[Mm]emset|copy|_to_copy|convert|cast"),
    ("triton other", r"^triton_|_kernel$"),
    ("elementwise / reduce", r""),
)


def kernel_class(name: str) -> str:
    return next(c for c, pattern in KERNEL_CLASSES if re.search(pattern, name))


def _union_ns(spans: list[tuple[int, int]]) -> int:
    busy, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def timeline_summary(kernels: list[tuple[int, int, int, str]], top: int = 12) -> str:
    """Where one step's GPU time went: per stream the busy time (union of its kernels) against the
    step's span; on the busiest stream (the compute stream) the time per kernel class, the idle time
    and how much of it another stream covered, and its longest gaps with the kernels around them."""
    if not kernels:
        return "timeline: no GPU activity recorded\n"
    t0 = min(k[1] for k in kernels)
    span = max(k[1] + k[2] for k in kernels) - t0
    by_stream: dict[int, list] = collections.defaultdict(list)
    for k in kernels:
        by_stream[k[0]].append(k)
    busy = {s: _union_ns([(k[1], k[1] + k[2]) for k in ks]) for s, ks in by_stream.items()}
    main = max(busy, key=busy.get)
    lines = [f"timeline: span {span / 1e6:.2f} ms; per stream: kernels, busy ms (% of span)"]
    for s in sorted(busy, key=busy.get, reverse=True):
        tag = "  <- compute (busiest)" if s == main else ""
        lines.append(f"  stream {s:>4}: {len(by_stream[s]):6d} {busy[s] / 1e6:9.2f} ({100 * busy[s] / span:5.1f}%){tag}")
    ks = sorted(by_stream[main], key=lambda k: k[1])
    classes = _totals(ks, key=kernel_class)
    names = _totals(ks, key=lambda name: name[:90])
    lines.append(f"compute stream {main}: kernel time by class (count, ms, % of span)")
    for c, (n, d) in sorted(classes.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {c:22s} {n:6d} {d / 1e6:9.2f} ({100 * d / span:5.1f}%)")
    others = [(k[1], k[1] + k[2]) for s, kk in by_stream.items() if s != main for k in kk]
    gaps, end, prev = [], t0, None
    for k in ks:
        if k[1] > end:
            gaps.append((k[1] - end, prev, k[3]))
        if k[1] + k[2] > end:
            end, prev = k[1] + k[2], k[3]
    if t0 + span > end:
        gaps.append((t0 + span - end, prev, "(end of step)"))
    idle = sum(g[0] for g in gaps)
    # idle time of the compute stream during which some other stream ran: union(main + others) - busy(main)
    covered = _union_ns([(k[1], k[1] + k[2]) for k in ks] + others) - busy[main]
    lines.append(f"  idle {idle / 1e6:.2f} ms in {len(gaps)} gaps ({100 * idle / span:.1f}% of span), of which "
                 f"{covered / 1e6:.2f} ms with another stream busy")
    before = _totals([(0, 0, g, b) for g, _, b in gaps if b != "(end of step)"], key=kernel_class)
    lines.append("  idle by the class of the kernel that ends the gap (gaps, ms): "
                 + ", ".join(f"{c} {n} {d / 1e6:.2f}" for c, (n, d) in sorted(before.items(), key=lambda kv: -kv[1][1])))
    lines.append("  longest gaps (ms: after -> before):")
    for g, a, b in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"    {g / 1e6:7.3f}: {(a or '(start)')[:60]} -> {b[:60]}")
    lines.append("  top kernels (count, ms):")
    for name, (n, d) in sorted(names.items(), key=lambda kv: -kv[1][1])[:2 * top]:
        lines.append(f"    {n:6d} {d / 1e6:9.2f}  {name}")
    return "\n".join(lines) + "\n"


def _totals(kernels: list[tuple[int, int, int, str]], key: Callable[[str], str]) -> dict[str, list[int]]:
    """[count, total ns] of the kernels per key(name)."""
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for _, _, d, name in kernels:
        t = totals[key(name)]
        t[0] += 1
        t[1] += d
    return totals


def kernel_table(kernels: list[tuple[int, int, int, str]]) -> str:
    """Every GPU kernel name of the step (all streams), longest total first: count, total ms, class."""
    names = _totals(kernels, key=lambda name: name)
    lines = ["every kernel (count, total ms, class, name):"]
    for name, (n, d) in sorted(names.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {n:6d} {d / 1e6:9.3f}  {kernel_class(name):20s} {name[:160]}")
    return "\n".join(lines) + "\n"


def count_syncs(trainer: Trainer, layout: ParallelLayout, args: argparse.Namespace, cfg: RunConfig,
                side: dist.ProcessGroup) -> int:
    """One more step under CUDA sync debug mode "warn": how many times this rank synchronised with
    the host (the step's one stats read included) and from where."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in OUR_CODE)]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in ours[::-1][:4])] += 1

    _align(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    total = sum(sites.values())
    lines = [f"{n:5d}  {site}" for site, n in sites.most_common()]
    _write_all_ranks(f"{total} host synchronisations in one step\n" + "\n".join(lines) + "\n",
                     _point_name("syncs", trainer), args, side, layout)
    return total


def start_memory_history() -> None:
    """Record allocations with their Python call sites from now on (before building the trainer of a
    point that memory_trace will analyse: then the allocations live between steps have call sites)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")


def memory_trace(trainer: Trainer, layout: ParallelLayout, args: argparse.Namespace, cfg: RunConfig,
                 side: dist.ProcessGroup, top: int = 40) -> int:
    """One more step with the allocator's history on: the allocations live at the step's start (what
    persists between steps; with call sites if start_memory_history ran before the trainer was
    built), this rank's peak above the start, and the allocations of the step live at that peak,
    grouped by (size, call site), largest first. Comparing two points shows which allocation makes
    their peaks differ. Returns the peak (bytes)."""
    mem = torch.cuda.memory
    _align(layout)
    start = torch.cuda.memory_allocated(layout.device)
    mem._record_memory_history(enabled="all", context="alloc", stacks="python")  # on (again): keeps call sites
    try:
        at_start = mem._snapshot(layout.device)
        mem._record_memory_history(enabled="all", context="alloc", stacks="python", clear_history=True)
        trainer.train_step()
        torch.cuda.synchronize(layout.device)
        snapshot = mem._snapshot(layout.device)
    finally:
        mem._record_memory_history(enabled=None)
    try:  # a diagnostic: a surprise in the snapshot's format must not end the benchmark
        text, peak = _peak_allocations(snapshot, start, top)
        text += "\nlive at the step's start:\n" + _live_blocks(at_start)
    except Exception as err:  # a diagnostic must not end the benchmark
        text, peak = f"could not analyse the snapshot: {err!r}\n", 0
    _write_all_ranks(text, _point_name("memory", trainer), args, side, layout)
    return start + peak


def _site(frames: list[dict]) -> str:
    ours = [f for f in frames if any(k in f["filename"] for k in OUR_CODE)]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']}" for f in ours[:3]) or "(no python frame)"


def _live_blocks(snapshot: dict) -> str:
    """Every group of (size, call site) among the allocated blocks of a snapshot, largest total first."""
    groups: dict[tuple, int] = collections.Counter()
    for seg in snapshot["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                groups[(b["size"], _site(b.get("frames", [])))] += 1
    rows = sorted(groups.items(), key=lambda kv: (-kv[0][0] * kv[1], kv[0][1]))
    total = sum(size * n for (size, _), n in rows)
    return (f"{total:,d} B in {sum(groups.values())} blocks\n"
            + "".join(f"{n:5d} x {size:>13,d} B = {size * n:>15,d} B  {site}\n" for (size, site), n in rows))


def _peak_allocations(snapshot: dict, start: int, top: int) -> tuple[str, int]:
    """(report, peak bytes above `start`) from an allocator snapshot with history."""
    events = [e for trace in snapshot["device_traces"] for e in trace if e["action"] in ("alloc", "free_requested")]
    live: dict[int, dict] = {}
    cur = peak = peak_at = 0
    for i, e in enumerate(events):  # allocated bytes change at alloc and at free request (as the stats do)
        cur += e["size"] if e["action"] == "alloc" else -e["size"]
        if cur > peak:
            peak, peak_at = cur, i + 1
    for e in events[:peak_at]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    groups: dict[tuple, list[int]] = {}
    for e in live.values():
        groups.setdefault((e["size"], _site(e.get("frames", []))), []).append(e["size"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"{len(v):5d} x {k[0]:>13,d} B = {sum(v):>15,d} B  {k[1]}" for k, v in rows[:top]]
    text = (f"allocated at the step's start {start:,d} B; peak {start + peak:,d} B (+{peak:,d} B within the step); "
            f"{len(events)} alloc/free events; {len(live)} allocations of this step live at the peak "
            f"({sum(e['size'] for e in live.values()):,d} B):\n" + "\n".join(lines) + "\n")
    return text, peak
