"""Expert-load heatmap: the PNG writer round-trips (read back with zlib, the format's own decoding), the
colour ramp maps known loads to known colours, and a training run writes, every heatmap_every logging
steps, the image of exactly the token counts the routers reported over those steps.

Reference: the routers' world-reduced counts recorded at each step (Trainer._balance_routers' result)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moontrain.metrics.heatmap import CELL_PX, colorize, heatmap_path, read_png, write_png
from moontrain.metrics.progress import ProgressLog
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import small_config


def test_png_round_trip(tmp_path: Path) -> None:
    img = np.random.default_rng(0).integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    path = write_png(tmp_path / "x.png", img)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(read_png(path), img)


def test_colour_ramp() -> None:
    E = 4
    share = np.array([[0.0, 0.25, 0.75, 0.0], [1.0, 0.0, 0.0, 0.0]])  # loads 0, 1x, 3x uniform; 4x is clipped
    img = colorize(share)
    assert img.shape == (2 * CELL_PX, E * CELL_PX, 3)
    cells = img[::CELL_PX, ::CELL_PX]
    assert cells[0, 0].tolist() == [13, 8, 135]  # no load: the darkest colour
    assert cells[0, 1].tolist() == [33, 145, 140]  # uniform: one third up the ramp
    assert cells[0, 2].tolist() == cells[1, 0].tolist() == [253, 231, 37]  # 3x and above: the brightest


def test_training_writes_the_routers_counts(tmp_path: Path) -> None:
    cfg = small_config("local", 1, steps=4, run_dir=str(tmp_path))
    cfg.metrics.heatmap_every = 2  # log_every=1: a heatmap after steps 2 and 4
    trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
    trainer.log = ProgressLog(tmp_path, cfg.train.steps)
    recorded = []
    balance = trainer._balance_routers

    def record(*args) -> torch.Tensor:
        counts_LE = balance(*args)
        recorded.append(counts_LE.double().clone())
        return counts_LE

    trainer._balance_routers = record
    for _ in range(4):
        trainer.train_step()
    for step, window in ((2, recorded[:2]), (4, recorded[2:])):
        counts = torch.stack(window).sum(0).numpy()
        want = colorize(counts / counts.sum(1, keepdims=True))
        got = read_png(heatmap_path(tmp_path, step))
        assert np.array_equal(got, want), step
    assert sorted(p.name for p in (tmp_path / "heatmaps").iterdir()) == [
        "expert_load_step_00000002.png", "expert_load_step_00000004.png"]
    trainer.close()
