"""bench_train's results: the rounds of a point merged into one, and the printed table (also for --show)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path


def merge_rounds(raw: list[dict], warmup: int) -> list[dict]:
    """One point per (backend, target) from its rounds: the median over every round's timed steps
    (rounds interleave the points in time, so a drift of the GPU's speed over the run is shared by
    all points instead of favouring the first), peaks as the max, retries summed; a point that
    failed in any round is reported as that failure."""
    merged: dict[tuple, list[dict]] = {}
    for p in raw:
        merged.setdefault((p["backend"], p["target_maxvio"]), []).append(p)
    out = []
    for ps in merged.values():
        bad = [p for p in ps if p.get("step_time_s") is None]
        if len(ps) == 1 or bad:
            out.append(bad[0] if bad else ps[0])
            continue
        timed = [t for p in ps for t in p["step_times_s"][warmup:]]
        med = statistics.median(timed)
        first = ps[0]
        scale = first["step_time_s"] / med  # tokens/s and MFU go as 1 / step time
        m = dict(first)
        m.update(
            step_time_s=med, round_step_time_s=[p["step_time_s"] for p in ps],
            step_times_s=[t for p in ps for t in p["step_times_s"]],
            tokens_per_s_per_gpu=first["tokens_per_s_per_gpu"] * scale,
            mfu_989=first["mfu_989"] * scale if first["mfu_989"] is not None else None,
            mfu_mm=first["mfu_mm"] * scale,
            maxvio_median=statistics.median([v for p in ps for v in p["maxvio_steps"][warmup:]]),
            maxvio_steps=[v for p in ps for v in p["maxvio_steps"]],
            redundant_experts_median=statistics.median([p["redundant_experts_median"] for p in ps]),
            peak_allocated_gib=_max_or_none([p["peak_allocated_gib"] for p in ps]),
            peak_reserved_gib=_max_or_none([p["peak_reserved_gib"] for p in ps]),
            peak_allocated_bytes=_max_or_none([p.get("peak_allocated_bytes") for p in ps]),
            step_peak_allocated_gib=([min(p["step_peak_allocated_gib"][0] for p in ps),
                                      max(p["step_peak_allocated_gib"][1] for p in ps)]
                                     if first["step_peak_allocated_gib"] else None),
            peak_requested_bytes=_max_or_none([p.get("peak_requested_bytes") for p in ps]),
            step_peak_requested_bytes=([min(p["step_peak_requested_bytes"][0] for p in ps),
                                        max(p["step_peak_requested_bytes"][1] for p in ps)]
                                       if first.get("step_peak_requested_bytes") else None),
            alloc_retries=sum(p["alloc_retries"] for p in ps) if first["alloc_retries"] is not None else None,
            **_merged_steady(ps),
            wall_s=sum(p["wall_s"] for p in ps), round=None, rounds=len(ps),
        )
        out.append(m)
    return out


def _merged_steady(ps: list[dict]) -> dict:
    """The steady-state window's numbers over rounds: the median round (by step time)."""
    have = sorted((p for p in ps if p.get("steady_step_time_s")), key=lambda p: p["steady_step_time_s"])
    if not have:
        return {}
    mid = have[(len(have) - 1) // 2]
    return {k: mid[k] for k in ("steady_step_time_s", "steady_tokens_per_s_per_gpu", "steady_mfu_989")}


def _max_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _f(v: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:>{width}{fmt}}"


HEADER = (f"{'backend':>8} {'target':>6} {'sigma':>8} {'calib':>6} {'train':>6} {'rank':>6} | {'step ms':>8} "
          f"{'wait ms':>7} {'tok/s/gpu':>9} {'mfu989':>6} {'mfu mm':>6} {'steady':>7} {'mfu st':>6} | {'peak GiB':>8} {'resv GiB':>8} {'step pk':>13} "
          f"{'retry':>5} {'heap':>5} {'oom':>4} {'copies':>6} {'plans':>5} | {'requested peak B':>17}")


def row(r: dict) -> str:
    if r.get("step_time_s") is None:
        return (f"{r['backend']:>8} {r['target_maxvio']:>6g} {r['sigma']:>8.4g} {r['calib_maxvio']:>6.2f} "
                f"{'-':>6} {'-':>6} | {'OOM' if r['oom'] else 'failed'} ({r.get('oom_rank_where')}, "
                f"{r['steps_done']} steps done)")
    pk = r["step_peak_allocated_gib"]
    step_pk = f"{pk[0]:.2f}-{pk[1]:.2f}" if pk else "-"
    pct = (lambda v: None if v is None else 100 * v)
    ms = (lambda v: None if v is None else 1e3 * v)
    return (f"{r['backend']:>8} {r['target_maxvio']:>6g} {r['sigma']:>8.4g} {r['calib_maxvio']:>6.2f} "
            f"{r['maxvio_median']:>6.2f} {_f(r['rank_maxvio_median'], '.2f', 6)} | {r['step_time_s'] * 1e3:>8.1f} "
            f"{_f(r.get('data_wait_ms_median'), '.2f', 7)} {r['tokens_per_s_per_gpu']:>9.0f} {_f(pct(r['mfu_989']), '.1f', 6)} {_f(pct(r['mfu_mm']), '.1f', 6)} "
            f"{_f(ms(r.get('steady_step_time_s')), '.1f', 7)} {_f(pct(r.get('steady_mfu_989')), '.1f', 6)} | "
            f"{_f(r['peak_allocated_gib'], '.2f', 8)} {_f(r['peak_reserved_gib'], '.2f', 8)} {step_pk:>13} "
            f"{_f(r['alloc_retries'], 'd', 5)} {r['symmetric_heap_gib']:>5.2f} {'yes' if r['oom'] else 'no':>4} "
            f"{_f(r.get('redundant_experts_median'), '.0f', 6)} {_f(r.get('pooled_plans'), 'd', 5)} | {_req(r):>17}")


def _req(r: dict) -> str:
    """Peak requested bytes; '~' marks a point whose timed steps did not all peak at the same value."""
    rng = r.get("step_peak_requested_bytes")
    if not rng:
        return "-"
    return f"{rng[1]:,d}" + ("" if rng[0] == rng[1] else "~")


def learning_row(r: dict) -> str:
    """The --learning-row point: speed at the recipe's learning rate beside its loss and routing."""
    if r.get("step_time_s") is None:
        return f"learning row ({r['backend']}): {'OOM' if r['oom'] else 'failed'} ({r.get('oom_rank_where')})"
    mfu = r.get("mfu_989")
    return (f"learning row ({r['backend']}, lr {r['lr']:g}, {Path(r['data']).name}): {r['step_time_s'] * 1e3:.1f} ms, "
            f"{r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, mfu989 {'-' if mfu is None else f'{100 * mfu:.1f}'} %, "
            f"loss {r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f}, maxvio median "
            f"{r['maxvio_median']:.2f}")


def print_table(result: dict) -> None:
    meta, points = result["config"], result["points"]
    if "learning" in result:
        print(learning_row(result["learning"]))
    print(f"{meta['recipe']} {' '.join(meta['overrides'])} | R={meta['world_size']} EP={meta['ep']} | "
          f"{meta['device']}, torch {meta['torch']} | {meta['tokens_per_step']} tokens/step | "
          f"popular experts {meta.get('placement', 'random')} | "
          f"median of {meta['steps']} steps after {meta['warmup']} warm-up x {meta.get('rounds', 1)} rounds | torch.mm {meta['compute_dtype']} "
          f"{meta['matmul_flops'] / 1e12:.2f} TFLOP/s")
    print("maxvio: calib = realised at calibration (initial weights), train = median over timed steps (max over "
          "MoE layers), rank = after planning (rows per rank); mfu989 vs 989 TFLOP/s bf16, mfu mm vs the torch.mm "
          "rate (%); wait ms = the time a step waited for its batch (the data loader's prefetch thread; median, "
          "max over ranks); steady / mfu st = mean step ms and MFU (989) of --window steps back to back (no "
          "per-step sync); "
          "peak/resv = torch allocator, max over ranks; step pk = per-step peak allocated range over "
          "timed steps; heap = moonep symmetric heap GiB (outside the allocator); copies = redundant expert copies "
          "per step over all MoE layers (median); plans = moonep's pooled plans at the end; requested peak = the most "
          "bytes tensors held at once in a timed step (max over ranks; peak GiB adds the allocator's rounding)")
    print(HEADER)
    for r in points:
        print(row(r))

