"""GPU timing shared by the one-GPU kernel benchmarks: the median of CUDA-event times after a warm-up."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over `iters` calls after `warmup` untimed ones, each timed by CUDA
    events around the call alone (the host waits for each call's end event)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
