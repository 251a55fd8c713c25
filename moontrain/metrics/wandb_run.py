"""The wandb run of a training job (rank 0 only).

Mode: the recipe's metrics.wandb_mode (offline by default) unless the WANDB_MODE environment variable
is set, which wandb users expect to win. Offline runs are written under <run_dir>/wandb and can be
uploaded later with `wandb sync`. The run id is stored in every checkpoint; a resumed job passes it
back with resume="allow", so its steps continue the same run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moontrain.metrics.config import MetricsConfig


class WandbRun:
    def __init__(self, cfg: MetricsConfig, *, run_dir: str | Path, config: dict[str, Any],
                 run_id: str | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ValueError("metrics.wandb=true needs the wandb package (pip install wandb); or set "
                             "metrics.wandb=false (console and metrics.jsonl only)") from err
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or cfg.wandb_mode
        self.run = wandb.init(
            project=cfg.project, name=cfg.run_name or run_dir.resolve().name, id=run_id,
            resume="allow", mode=mode, dir=str(run_dir), config=config,
            settings=wandb.Settings(x_disable_stats=True, console="off", silent=True),
        )
        self.id = self.run.id
        self.sync_dir = Path(self.run.settings.sync_dir)  # what `wandb sync` uploads (offline runs)
        self._said_no_pillow = False

    def log_image(self, key: str, path: str | Path, step: int) -> None:
        """An image file at `step` (wandb.Image needs pillow; without it the image is not logged, once said)."""
        import wandb

        try:
            import PIL  # noqa: F401
        except ImportError:
            if not self._said_no_pillow:
                print(f"moontrain: {key} is not logged to wandb: wandb.Image needs the pillow package (pip install "
                      f"pillow); the PNG files are under {Path(path).parent}", flush=True)
                self._said_no_pillow = True
            return
        self.run.log({key: wandb.Image(str(path))}, step=step)

    def log(self, values: dict[str, float | int | None], step: int) -> None:
        self.run.log(values, step=step)

    def backfill(self, records: list[dict[str, float | int | None]], run_dir: str | Path) -> int:
        """Offline: log the metrics.jsonl records (steps up to the resumed checkpoint) that no earlier offline file
        of this run holds, e.g. what a killed job had not flushed; returns how many. Online runs: nothing (the
        server has what it received)."""
        if not self.run.offline:
            return 0
        from moontrain.metrics.wandb_offline import read_history, run_files

        present = {row["_step"] for f in run_files(run_dir) if f.stem == f"run-{self.id}" and f.parent != self.sync_dir
                   for row in read_history(f)}
        missing = [r for r in records if r["step"] not in present]
        for r in missing:
            self.log({k: v for k, v in r.items() if k != "step" and v is not None}, step=int(r["step"]))
        return len(missing)

    def finish(self) -> None:
        self.run.finish()
