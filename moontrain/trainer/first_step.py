"""The first training step's wait on a GPU, said before it and accounted after it (rank 0's console).

Before (first_step_note): what the step does besides training (torch.compile of the dense layers, fla's
autotuning of its KDA kernels and whether its shipped tile choices were seeded, Triton compiling moonep's
kernels); none of it happens again in later steps.

After (FirstStepClock, read by Trainer.fit after the job's first step), one line:

    first step 41.2 s (torch.compile 24.9 s; fla autotune: 0 shapes searched, 42 entries seeded from ...)

- the step's wall time: it ends in the step's one host read (moontrain.trainer.guard), so the GPU work of
  the step is inside it;
- torch.compile: the host time torch._dynamo spent compiling during the step, frames and their lazily
  compiled backward graphs (calculate_time_spent's total_wall_time, the sum of its entire_frame_compile and
  entire_backward_compile), read without a GPU sync; left out below 0.05 s;
- fla autotune: the autotune results the step added to Triton's cache (fla writes one per kernel and
  shape it searched; by default nothing else writes them: moonep's autotune keeps its choices in memory),
  counted on rank 0's host, with what seeding did (moontrain.trainer.kernel_cache).

The rest of the total (fla's searches, Triton compiling moonep's and fla's kernels, the step's own work)
cannot be told apart without a sync per kernel, so it is not split.
"""

from __future__ import annotations

import time

import torch

from moontrain.config import RunConfig
from moontrain.model.kda import uses_fla
from moontrain.trainer.kernel_cache import FlaSeed, autotune_entries


def first_step_note(cfg: RunConfig, device: torch.device, fla_seed: FlaSeed | None = None) -> str | None:
    """What makes the first GPU step slow, said before it starts (it can take a minute or more). fla_seed:
    what seeding Triton's cache did (None: not seeded)."""
    if device.type != "cuda":
        return None
    fla = "fla autotunes its KDA kernels"
    if fla_seed is not None and fla_seed.mismatch is not None:
        fla += f" for every shape (minutes; {fla_seed.describe()})"
    elif fla_seed is not None:
        fla += f" for shapes beyond the {fla_seed.describe()} (Triton's cache: {fla_seed.cache_dir})"
    work = [what for what, on in (
        ("torch.compile compiles the dense layers (train.compile)", cfg.train.compile),
        (fla, uses_fla(cfg.model, cfg.kernels.kda, device)),
        ("Triton compiles moonep's kernels", cfg.experts.backend == "moonep")) if on]
    if not work:
        return None
    return f"the first step also {'; '.join(work)}: it can take a minute or more (later steps reuse them)"


def compile_seconds() -> float:
    """Host seconds torch.compile has spent in this process so far (frames and lazy backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent()["total_wall_time"]


class FirstStepClock:
    """Started right before the first step; line() after it says what the wait was."""

    def __init__(self, fla_seed: FlaSeed | None) -> None:
        self.fla_seed = fla_seed
        self.entries = autotune_entries(fla_seed.cache_dir) if fla_seed is not None else 0
        self.compiled_s = compile_seconds()
        self.t0 = time.perf_counter()

    def measure(self) -> tuple[float, float, int]:
        """(seconds since the start, of them torch.compile's, autotune entries added to the cache)"""
        total_s = time.perf_counter() - self.t0
        searched = autotune_entries(self.fla_seed.cache_dir) - self.entries if self.fla_seed is not None else 0
        return total_s, compile_seconds() - self.compiled_s, searched

    def line(self) -> str:
        total_s, compile_s, searched = self.measure()
        return first_step_line(total_s, compile_s, self.fla_seed, searched)


def first_step_line(total_s: float, compile_s: float, fla_seed: FlaSeed | None, searched: int) -> str:
    """The console line after the first step. fla_seed None: the run does not use fla."""
    parts = [f"torch.compile {compile_s:.1f} s"] if compile_s >= 0.05 else []
    if fla_seed is not None:
        parts.append(f"fla autotune: {searched} shape{'' if searched == 1 else 's'} searched, {fla_seed.describe()}")
    return f"first step {total_s:.1f} s" + (f" ({'; '.join(parts)})" if parts else "")
