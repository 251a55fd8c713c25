"""Checkpoint configuration: where, how often, how many to keep, and whether to resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None  # default: <train.run_dir>/checkpoints
    every: int = 0  # save every this many steps (0: no step-based saves)
    # save when this many minutes of the job have passed since its start or its last save (0: no time-based
    # saves): what a kill (OOM, a lost node) can cost, whatever the step time
    every_minutes: float = 30.0
    save_final: bool = True  # save after the last step
    keep_last: int = 3  # older complete checkpoints are deleted after a successful save
    # "auto": the latest valid checkpoint in `dir` (fresh when there is none): relaunching continues the run;
    # "none": start over (the earlier checkpoints and metrics are moved aside, see checkpoint/resume.py);
    # anything else: the path of one checkpoint directory
    resume: str = "auto"
    # a new run's initial weights: a Hugging Face model directory (an export, or a DeepSeek-V3 / Kimi K2
    # checkpoint of the same architecture) or a moontrain checkpoint (its weights only); a resumed run
    # takes its weights from the checkpoint it resumes instead
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0 (0: no step-based saves), got {self.every}")
        if not 0 <= self.every_minutes < float("inf"):
            raise ValueError(f"checkpoint.every_minutes must be a finite number >= 0 (0: no time-based saves), got "
                             f"{self.every_minutes}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        if self.init_from is not None and not self.init_from:
            raise ValueError("checkpoint.init_from must be a model directory or null, got ''")
        if not self.resume:
            raise ValueError("checkpoint.resume must be 'none', 'auto' or a checkpoint directory, got ''")

    def describe(self, run_dir: str) -> str:
        """The save policy in one line (the launcher prints it), with what a kill can lose."""
        when = [w for w in (f"every {self.every_minutes:g} min of training" if self.every_minutes else "",
                            f"every {self.every} steps" if self.every else "",
                            "at the end" if self.save_final else "") if w]
        line = f"checkpoints: {', '.join(when) or 'none'}, the last {self.keep_last} kept, in " \
               f"{self.dir or Path(run_dir) / 'checkpoints'}"
        if not self.every and not self.every_minutes:
            line += " (a kill before the end loses the whole run: set checkpoint.every_minutes)"
        return line
