"""Step metrics accumulated on device between logging steps; one reduction and one host read per log
(`launch`, then `read`, at once or, in Trainer.fit, after the next step is queued).

Between two logging steps nothing is read on the host: the loss, the grad norm and the per-layer MoE
statistics are added into device tensors. At a logging step the values that differ between ranks
(the loss of each rank's tokens, the prefetch bytes of each rank) go through one all_reduce; the
others are identical on every rank already (global grad norm, world-reduced counts, shared plans).
Reported values are means over the steps of the window; tokens/s and MFU use the window's time on the
device's clock (CUDA events at each window's launch), so a window read a step late still counts its own span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moontrain.metrics.host_read import HostRead
from moontrain.metrics.moe_stats import FIELDS
from moontrain.parallel.layout import ParallelLayout


class MetricsWindow:
    def __init__(self, moe_layer_ids: list[int], layout: ParallelLayout) -> None:
        """moe_layer_ids: the model layer index of each MoE layer (names the per-layer series)."""
        self.layer_ids, self.num_layers, self.layout = moe_layer_ids, len(moe_layer_ids), layout
        self._reset()
        self.restart_clock()

    def _reset(self) -> None:
        dev = self.layout.device
        self.ce_sum = torch.zeros((), dtype=torch.float64, device=dev)
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=dev)
        self.moe_sum = torch.zeros(len(FIELDS), self.num_layers, dtype=torch.float64, device=dev)
        self.steps = 0

    def restart_clock(self) -> None:
        """Start timing now (a job's first window should not include building, loading or wandb startup)."""
        self._start, self._excluded = self._mark(), 0.0

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of host time out of the open window (a checkpoint save, an evaluation)."""
        self._excluded += seconds

    def _mark(self) -> torch.cuda.Event | float:
        """A point on the device's clock (a CUDA event recorded behind the queued work) or, on a CPU, the host's
        (its ops ran when they were called)."""
        if self.layout.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, ce: torch.Tensor, grad_norm: torch.Tensor, moe_FL: torch.Tensor) -> None:
        self.ce_sum += ce.detach().double()
        self.grad_norm_sum += grad_norm.double()
        self.moe_sum += moe_FL
        self.steps += 1

    def launch(self) -> WindowRead:
        """Collective, no host read: the window's sums reduced on the device and their copy to the host
        started (moontrain.metrics.host_read); a new window starts accumulating. `read` gives its means."""
        layout = self.layout
        prefetch = FIELDS.index("prefetch_bytes")
        varying = torch.cat([self.ce_sum.view(1), self.moe_sum[prefetch]])
        if layout.distributed:
            dist.all_reduce(varying, group=layout.world_group)
            varying /= layout.world_size  # prefetch bytes: the mean over ranks
        moe = self.moe_sum.clone()
        moe[prefetch] = varying[1:]
        values = torch.cat([varying[:1], self.grad_norm_sum.view(1), moe.flatten()]).div(self.steps)
        end = self._mark()
        pending = WindowRead(HostRead(values), self.steps, self._start, end, self._excluded)
        self._reset()
        self._start, self._excluded = end, 0.0
        return pending

    def read(self, pending: WindowRead) -> dict[str, float]:
        """A launched window's means (waits for its values only). Its time runs on the device's clock from the
        previous window's launch (or restart_clock) to its own, less what `exclude` left out: the same span
        for every window however late the host reads it (Trainer.fit reads a step's window in the next step)."""
        L = self.num_layers
        values = pending.host.read()
        if isinstance(pending.start, float):
            span = pending.end - pending.start
        else:
            span = pending.start.elapsed_time(pending.end) / 1e3
        elapsed = max(span - pending.excluded_s, 1e-9)
        out = {"loss": values[0], "grad_norm": values[1], "window_s": elapsed, "window_steps": float(pending.steps)}
        per_field = [values[2 + f * L: 2 + (f + 1) * L] for f in range(len(FIELDS))]
        for name, series in zip(FIELDS, per_field, strict=True):
            for layer_id, v in zip(self.layer_ids, series, strict=True):
                out[f"moe/{name}/layer{layer_id}"] = v
            out[f"moe/{name}/max" if "maxvio" in name else f"moe/{name}/total"] = (
                (max(series) if "maxvio" in name else sum(series)) if series else 0.0)
        return out


@dataclass(frozen=True, slots=True)
class WindowRead:
    host: HostRead  # the window's means, [2 + len(FIELDS) * L]: loss, grad norm, then FIELDS by layer
    steps: int
    start: torch.cuda.Event | float  # MetricsWindow._mark at the window's start and at its launch
    end: torch.cuda.Event | float
    excluded_s: float


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocator statistics in GiB (and the retry count) on CUDA; nothing elsewhere."""
    if device.type != "cuda":
        return {}
    gib = 2**30
    stats = torch.cuda.memory_stats(device)
    return {"mem/allocated_gib": torch.cuda.memory_allocated(device) / gib,
            "mem/reserved_gib": torch.cuda.memory_reserved(device) / gib,
            "mem/peak_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem/alloc_retries": float(stats.get("num_alloc_retries", 0))}
