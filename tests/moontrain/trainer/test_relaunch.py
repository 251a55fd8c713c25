"""End to end: a parquet of text and the trained tokenizer.json train k3_tiny at EP = 2 with evaluation; the
run is killed (SIGKILL to every process) after a checkpoint and relaunched with the same command: it
continues from the checkpoint, its losses and eval losses are bitwise those of an uninterrupted run, and
metrics.jsonl holds every logged step once; the wandb run continues under the same id. Then a relaunch with
checkpoint.resume=none starts over and moves the earlier run aside.

Reference: the same command run without interruption in another run directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from moontrain.metrics.heatmap import CELL_PX, heatmap_path, read_png  # noqa: E402
from moontrain.metrics.wandb_offline import main as print_history  # noqa: E402
from moontrain.metrics.wandb_offline import read_history, run_files  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = REPO / "recipes" / "data" / "tiny_tokenizer.json"
STEPS, CKPT_EVERY = 16, 4


def _command(run_dir: Path, parquet: Path, eval_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moontrain.cli", "launch", "recipes/k3_tiny.yaml", f"train.run_dir={run_dir}",
            f"data.path={parquet}", f"data.tokenizer={TOKENIZER}", "model.vocab_size=384", f"train.steps={STEPS}",
            "train.seq_len=32", "train.log_every=2", f"checkpoint.every={CKPT_EVERY}", "checkpoint.keep_last=5",
            "eval.every=4", "eval.steps=1", f"eval.data.path={eval_file}", "--nproc", "2", *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", WANDB_MODE="offline")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _launch_and_kill(cmd: list[str], run_dir: Path) -> None:
    """Start the run; SIGKILL the launcher, torchrun and the workers once a step after the first checkpoint
    is logged (so the killed job logged steps the checkpoint does not hold)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            done = (run_dir / "checkpoints" / f"step_{CKPT_EVERY:08d}" / "manifest.json").is_file()
            metrics = run_dir / "metrics.jsonl"
            if done and metrics.is_file() and any(json.loads(line)["step"] > CKPT_EVERY for line in
                                                  metrics.read_text().splitlines() if line.endswith("}")):
                break
            time.sleep(0.02)
        else:
            raise TimeoutError("no step after the first checkpoint was logged")
    finally:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


@pytest.mark.slow
def test_killed_run_relaunched_continues_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    texts = [json.loads(line)["text"] for line in (REPO / "recipes" / "data" / "tiny_corpus.jsonl").read_text()
             .splitlines()]
    parquet, eval_file = tmp_path / "train.parquet", tmp_path / "heldout.jsonl"
    datasets.Dataset.from_dict({"text": texts[:900]}).to_parquet(str(parquet))
    eval_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[900:]))
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    _run(_command(ref_dir, parquet, eval_file))
    reference = _records(ref_dir)
    assert [r["step"] for r in reference] == list(range(2, STEPS + 1, 2))
    assert all(("eval/loss" in r) == (r["step"] % 4 == 0) for r in reference)

    _launch_and_kill(_command(run_dir, parquet, eval_file), run_dir)
    killed_steps = [r["step"] for r in _records(run_dir)]
    last_ckpt = max(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_????????"))
    assert max(killed_steps) > last_ckpt and last_ckpt < STEPS, (killed_steps, last_ckpt)

    proc = _run(_command(run_dir, parquet, eval_file))  # the same command
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{last_ckpt:08d}'} at step {last_ckpt}" in proc.stdout
    records = _records(run_dir)
    assert [r["step"] for r in records] == [r["step"] for r in reference], "every logged step exactly once"
    for got, want in zip(records, reference, strict=True):
        for key in ("loss", "eval/loss", "eval/ppl", "grad_norm", "data/tokens/data", "tokens_seen"):
            assert got.get(key) == want.get(key), (got["step"], key, got.get(key), want.get(key))
    assert f"best eval loss {min(r['eval/loss'] for r in reference if 'eval/loss' in r):.4f}" in proc.stdout
    assert f"wandb sync {run_dir / 'wandb'}" in proc.stdout
    ids = {f.stem for f in run_files(run_dir)}
    assert len(ids) == 1 and len(run_files(run_dir)) == 2, "the relaunch continues the same wandb run"
    killed_file, resumed = run_files(run_dir)  # offline-run-<time>-<id>: in launch order
    new_steps = list(range(last_ckpt + 2, STEPS + 1, 2))
    assert [h["_step"] for h in read_history(resumed)][-len(new_steps):] == new_steps
    # a SIGKILLed job may not have flushed its last rows to wandb: the relaunch logs the missing ones again
    history = {h["_step"]: h for h in read_history(killed_file) if h["_step"] <= last_ckpt}
    history |= {h["_step"]: h for h in read_history(resumed)}
    assert sorted(history) == [r["step"] for r in reference]
    assert all(history[r["step"]]["loss"] == r["loss"] for r in reference)
    last = read_history(resumed)[-1]
    assert last["moe/expert_load/_type"] == "image-file", "the expert-load heatmap is logged to wandb"
    assert read_png(heatmap_path(run_dir, STEPS)).shape == (2 * CELL_PX, 8 * CELL_PX, 3)  # 2 MoE layers x 8 experts
    capsys.readouterr()
    assert print_history([str(run_dir)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["step", "loss", "eval_loss", "wait_ms", "layer1", "layer2"]
    assert [int(line.split()[0]) for line in table[1:]] == [r["step"] for r in reference]

    # starting over is explicit: the earlier run's checkpoints and metrics are moved aside, nothing deleted
    proc = _run(_command(run_dir, parquet, eval_file, "checkpoint.resume=none", "train.steps=2"))
    assert "starting over" in proc.stdout and "resumed from" not in proc.stdout
    assert [r["step"] for r in _records(run_dir)] == [2]
    assert _records(run_dir)[0]["loss"] == reference[0]["loss"]
    moved = list((run_dir / "checkpoints").glob("discarded-*/step_*"))
    assert len(moved) >= 2 and list(run_dir.glob("metrics.discarded-*.jsonl"))
