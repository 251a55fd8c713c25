"""Per-step progress: one console line, one metrics.jsonl record and one wandb log call (rank 0); the
end-of-run summary.

The three carry the same scalars: StepStats' fields plus `scalars` (memory, data wait and per-source
tokens, held-out loss on evaluation steps, and per MoE layer the expert-level and rank-level maxvio,
redundant experts and prefetch bytes, with their max / total).

metrics.jsonl never holds a step twice: a job that starts at step s (0, or the step of the checkpoint it
resumed from) keeps the records of steps <= s and drops the rest, which the job logs again.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
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


def format_seconds(seconds: float) -> str:
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLog:
    def __init__(self, run_dir: str | Path | None, total_steps: int, *, sink: MetricsSink | None = None,
                 start_step: int = 0) -> None:
        """start_step: the job's first step is start_step + 1; records after start_step are dropped."""
        self.total_steps, self.sink, self.start_step = total_steps, sink, start_step
        self.t0 = time.perf_counter()
        self.last: StepStats | None = None
        self.best_eval: tuple[float, int] | None = None  # (loss, step) of this job's evaluations
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
        self.kept: list[dict] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep = [line for line in self._records() if json.loads(line)["step"] <= start_step]
            self.kept = [json.loads(line) for line in keep]  # the earlier jobs' records this job continues
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)

    def _records(self) -> list[str]:
        if self.path is None or not self.path.is_file():
            return []
        lines = []
        for line in self.path.read_text().splitlines():
            try:
                json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed job
                continue
            lines.append(line)
        return lines

    def log(self, stats: StepStats) -> None:
        width = len(str(self.total_steps))
        s = stats.scalars
        elapsed = time.perf_counter() - self.t0
        eta = (self.total_steps - stats.step) * stats.step_time_s
        print(f"step {stats.step:>{width}}/{self.total_steps} | loss {stats.loss:.4f}"
              + (f" | eval {s['eval/loss']:.4f} (ppl {s['eval/ppl']:.2f})" if "eval/loss" in s else "")
              + f" | lr {stats.lr:.3e} | "
              f"gnorm {stats.grad_norm:.3f} | {stats.tokens_per_s:,.0f} tok/s | {stats.step_time_s * 1e3:.0f} ms | "
              f"max maxvio {stats.max_maxvio:.3f}"
              + (f" | rank maxvio {s['moe/rank_maxvio/max']:.3f}" if "moe/rank_maxvio/max" in s else "")
              + (f" | redundant {s['moe/redundant_experts/total']:.0f}" if "moe/redundant_experts/total" in s else "")
              + (f" | mfu {stats.mfu:.1%}" if stats.mfu is not None else "")
              + (f" | peak mem {stats.peak_mem_gib:.1f} GiB" if stats.peak_mem_gib is not None else "")
              + (f" | data wait {s['data/wait_ms']:.1f} ms" if "data/wait_ms" in s else "")
              + (f" | device wait {s['time/device_wait_ms']:.1f} ms" if "time/device_wait_ms" in s else "")
              + f" | elapsed {format_seconds(elapsed)} | eta {format_seconds(eta)}", flush=True)
        self.last = stats
        if "eval/loss" in s and (self.best_eval is None or s["eval/loss"] < self.best_eval[0]):
            self.best_eval = (s["eval/loss"], stats.step)
        values = stats.flat()
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(values) + "\n")
        if self.sink is not None:
            self.sink.log({k: v for k, v in values.items() if k != "step" and v is not None}, stats.step)

    def image(self, key: str, path: Path, step: int) -> None:
        """An image file (the expert-load heatmap) to wandb, at the step just logged."""
        log_image = getattr(self.sink, "log_image", None)
        if log_image is not None:
            log_image(key, path, step)

    def summary(self, *, step: int, tokens_seen: int, checkpoint: Path | None, wandb_dir: Path | None,
                files: Sequence[Path] = ()) -> str:
        """The end-of-run lines: steps, tokens, wall time, final and best held-out loss, the run's files
        (`files`: config.yaml, console.log), metrics, checkpoint, wandb."""
        trained = (f"this job {format_seconds(time.perf_counter() - self.t0)} for steps {self.start_step + 1}-{step}"
                   if step > self.start_step else "this job trained no step")
        lines = [f"moontrain: done at step {step}/{self.total_steps}: {tokens_seen:,} tokens seen, {trained}"]
        if self.last is not None:
            s = self.last.scalars
            line = f"  final train loss {self.last.loss:.4f}"
            if "eval/loss" in s:
                line += f", final eval loss {s['eval/loss']:.4f} (ppl {math.exp(s['eval/loss']):.2f})"
            if self.best_eval is not None:
                line += f", best eval loss {self.best_eval[0]:.4f} at step {self.best_eval[1]}"
            lines.append(line)
        lines += [f"  {f.stem}: {f}" for f in files]
        if self.path is not None:
            lines.append(f"  metrics: {self.path}")
            heatmaps = sorted((self.path.parent / "heatmaps").glob("expert_load_step_*.png"))
            if heatmaps:
                lines.append(f"  expert-load heatmaps: {heatmaps[-1].parent} (latest {heatmaps[-1].name})")
        if checkpoint is not None:
            lines.append(f"  checkpoint: {checkpoint}")
        if wandb_dir is not None:
            lines.append(f"  wandb: {wandb_dir} (upload: wandb sync {wandb_dir})")
        return "\n".join(lines)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.finish()
