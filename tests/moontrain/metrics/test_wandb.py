"""The offline wandb run of the tiny recipe: read back from wandb's own run file, it holds per MoE layer the
expert-level and rank-level maxvio series (and the other step scalars), equal to the metrics.jsonl records;
a resumed launch continues the same wandb run id and the same metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moontrain.metrics.wandb_offline import read_history, run_files

REPO = Path(__file__).resolve().parents[3]
MOE_LAYERS = (1, 2)  # k3_tiny: layer 0 is dense


def _launch(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "-m", "moontrain.cli", "launch", "recipes/k3_tiny.yaml",
                           f"train.run_dir={run_dir}", "train.log_every=2", *overrides, "--nproc", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _check_same_scalars(history: list[dict], records: list[dict]) -> None:
    assert [h["_step"] for h in history] == [r["step"] for r in records]
    for h, r in zip(history, records, strict=True):
        for key, value in r.items():
            if key == "step" or value is None:
                continue
            assert h[key] == value, (r["step"], key, h[key], value)


@pytest.mark.slow
def test_offline_wandb_run_holds_the_maxvio_series(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _launch(run_dir, "train.steps=8")
    files = run_files(run_dir)
    assert len(files) == 1
    run_id = files[0].stem.removeprefix("run-")
    history = read_history(files[0])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [2, 4, 6, 8]
    for row in history:
        for kind in ("expert_maxvio", "rank_maxvio", "redundant_experts", "prefetch_bytes"):
            for layer in MOE_LAYERS:
                assert f"moe/{kind}/layer{layer}" in row, (kind, layer, sorted(row))
        expert = [row[f"moe/expert_maxvio/layer{i}"] for i in MOE_LAYERS]
        assert row["moe/expert_maxvio/max"] == max(expert) == row["max_maxvio"]
        assert max(expert) > 0  # a freshly initialised router is not balanced
        assert row["moe/rank_maxvio/max"] == 0.0  # moonep balances every rank exactly
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens_seen"):
            assert key in row
    _check_same_scalars(history, records)

    # resume from the final checkpoint: the same wandb run continues, metrics.jsonl grows
    state = json.loads((run_dir / "checkpoints" / "step_00000008" / "train_state.json").read_text())
    assert state["wandb_run_id"] == run_id
    proc = _launch(run_dir, "train.steps=12", "checkpoint.resume=auto")
    assert "resumed from" in proc.stdout and "step_00000008 at step 8" in proc.stdout
    files = run_files(run_dir)
    assert len(files) == 2 and {f.stem for f in files} == {f"run-{run_id}"}
    resumed = next(f for f in files if read_history(f)[0]["_step"] == 10)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    _check_same_scalars(read_history(resumed), records[4:])
