"""GPU timing shared by the one-GPU kernel benchmarks: the median of CUDA-event times after a warm-up, the
command line of a kernel sweep, and one tile of a sweep timed against its reference."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

# host_ahead_ms for a call of one or two kernel launches: longer than its host work (checks, allocations, launches:
# tens of us), short against a sweep
ONE_CALL_AHEAD_MS = 1.0


def median_ms(fn: Callable[[], object], iters: int, warmup: int, *, host_ahead_ms: float = 0.0) -> float:
    """Median milliseconds of fn() over `iters` calls after `warmup` untimed ones, each timed by CUDA
    events around the call alone (the host waits for each call's end event). host_ahead_ms > 0: the device
    first spins that long (torch.cuda._sleep, at ~2 GHz) before the start event, so the host's work of
    launching fn overlaps the spin and the time is the device's alone, as in a step whose host runs ahead
    of its kernels (give more than the call's host time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if host_ahead_ms > 0:
            torch.cuda._sleep(int(host_ahead_ms * 2e6))
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_bench_args(doc: str | None, name: str, **extra: dict) -> argparse.Namespace:
    """--iters, --warmup and --out of a one-GPU kernel benchmark (`doc` its help), and --<key> for each of
    `extra` (add_argument's keywords); exits without a CUDA GPU."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, kwargs in extra.items():
        p.add_argument(f"--{key}", **kwargs)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=str, default=None, help="JSON path (none: the table only)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU")
    return args


def sweep_tile(call: Callable[[], tuple], compare: Callable[[tuple], tuple[list[float], float]], row: dict,
               args: argparse.Namespace, host_ahead_ms: float, widths: tuple[int, int]) -> dict:
    """One tile of a kernel sweep (row: its documents and variant names): run once, a tile whose pipeline does not
    fit the SM's shared memory named and skipped; compare(outputs) -> (% of each output bitwise the reference's,
    the largest difference over the reference's largest value); then timed (median_ms). The row, filled in, is
    printed (variant column widths[0] wide, the bitwise column widths[1]) and returned."""
    from triton.runtime.errors import OutOfResources

    lead = f"{row['documents']:<10} {row['variant']:<{widths[0]}}"
    try:
        got = call()
    except OutOfResources as e:
        print(f"{lead} {'does not fit: ' + str(e)[:60]}", flush=True)
        return dict(row, error=str(e))
    same, rel = compare(got)
    us = 1e3 * median_ms(call, args.iters, args.warmup, host_ahead_ms=host_ahead_ms)
    print(f"{lead} {us:>8.1f} {'/'.join(f'{s:.1f}' for s in same):>{widths[1]}} {rel:>12.2e}", flush=True)
    return dict(row, us=us, bitwise_pct=same, max_rel_diff=rel)


def write_sweep(path: str | None, case: str, rows: list[dict]) -> None:
    """The sweep's rows as JSON at path (none: nothing), with the device's name and the case."""
    if path:
        Path(path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "case": case, "rows": rows},
                                         indent=1) + "\n")
