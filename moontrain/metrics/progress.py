"""Per-step progress: one console line (rank 0) and one jsonl record in the run directory."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(kw_only=True, slots=True)
class StepStats:
    step: int
    loss: float  # cross-entropy averaged over all ranks (without the aux loss)
    lr: float
    grad_norm: float
    tokens_per_s: float  # global tokens per second
    step_time_s: float
    max_maxvio: float  # expert-level maxvio, max over MoE layers (before this step's bias update)
    mfu: float | None = None  # model FLOPs utilisation per GPU (None off GPU or on an unknown GPU)
    peak_mem_gib: float | None = None  # torch.cuda.max_memory_allocated on rank 0


class ProgressLog:
    def __init__(self, run_dir: str | Path | None, total_steps: int) -> None:
        self.total_steps = total_steps
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def log(self, stats: StepStats) -> None:
        width = len(str(self.total_steps))
        print(f"step {stats.step:>{width}}/{self.total_steps} | loss {stats.loss:.4f} | lr {stats.lr:.3e} | "
              f"gnorm {stats.grad_norm:.3f} | {stats.tokens_per_s:,.0f} tok/s | {stats.step_time_s * 1e3:.0f} ms | "
              f"max maxvio {stats.max_maxvio:.3f}"
              + (f" | mfu {stats.mfu:.1%}" if stats.mfu is not None else "")
              + (f" | peak mem {stats.peak_mem_gib:.1f} GiB" if stats.peak_mem_gib is not None else ""), flush=True)
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(asdict(stats)) + "\n")
