"""Per-step progress: one console line, one metrics.jsonl record and one wandb log call (rank 0).

The three carry the same scalars: StepStats' fields plus `scalars` (memory, and per MoE layer the
expert-level and rank-level maxvio, redundant experts and prefetch bytes, with their max / total).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(kw_only=True, slots=True)
class StepStats:
    step: int
    loss: float  # cross-entropy over all ranks' tokens, mean over the logging window (without the aux loss)
    lr: float  # of the last step of the window
    grad_norm: float  # global norm before clipping, mean over the window
    tokens_per_s: float  # global tokens per second over the window
    step_time_s: float  # mean over the window
    max_maxvio: float  # expert-level maxvio (before balancing), max over MoE layers of the window means
    mfu: float | None = None  # model FLOPs utilisation per GPU (None off GPU or on an unknown GPU)
    peak_mem_gib: float | None = None  # torch.cuda.max_memory_allocated on rank 0
    scalars: dict[str, float] = field(default_factory=dict)

    def flat(self) -> dict[str, float | int | None]:
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "scalars"}, **self.scalars}


class MetricsSink(Protocol):
    def log(self, values: dict[str, float | int | None], step: int) -> None: ...

    def finish(self) -> None: ...


class ProgressLog:
    def __init__(self, run_dir: str | Path | None, total_steps: int, *, sink: MetricsSink | None = None,
                 append: bool = False) -> None:
        """append: keep the records of an earlier run (a resumed run continues the same file)."""
        self.total_steps, self.sink = total_steps, sink
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not (append and self.path.exists()):
                self.path.write_text("")

    def log(self, stats: StepStats) -> None:
        width = len(str(self.total_steps))
        s = stats.scalars
        print(f"step {stats.step:>{width}}/{self.total_steps} | loss {stats.loss:.4f} | lr {stats.lr:.3e} | "
              f"gnorm {stats.grad_norm:.3f} | {stats.tokens_per_s:,.0f} tok/s | {stats.step_time_s * 1e3:.0f} ms | "
              f"max maxvio {stats.max_maxvio:.3f}"
              + (f" | rank maxvio {s['moe/rank_maxvio/max']:.3f}" if "moe/rank_maxvio/max" in s else "")
              + (f" | redundant {s['moe/redundant_experts/total']:.0f}" if "moe/redundant_experts/total" in s else "")
              + (f" | mfu {stats.mfu:.1%}" if stats.mfu is not None else "")
              + (f" | peak mem {stats.peak_mem_gib:.1f} GiB" if stats.peak_mem_gib is not None else ""), flush=True)
        values = stats.flat()
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(values) + "\n")
        if self.sink is not None:
            self.sink.log({k: v for k, v in values.items() if k != "step" and v is not None}, stats.step)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.finish()
