"""`moontrain launch`: the k3_tiny recipe trains on CPU under torchrun (2 gloo ranks) and its loss falls,
printing no Python warning or traceback; relaunching it with another optimizer fails before any worker
starts; --dry-run plans the full K3 without allocating, and plans for the host it runs on by default; bad
configurations and data fail before torchrun starts, naming the key; `checkpoints` lists a run's
checkpoints; `--version`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from moontrain.cli import main
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.model.params import count_params

REPO = Path(__file__).resolve().parents[2]
STEPS = 20  # test_launch_k3_tiny_loss_falls: the recipe's 60 steps cut to 20 (its docstring says why)


def _moontrain(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "moontrain.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["moonep"])  # the all-to-all trainer: test_learning, test_ep_equality
def test_launch_k3_tiny_loss_falls(tmp_path: Path, backend: str) -> None:
    """The recipe as shipped except train.steps=20 (of 60): what this test checks is the launch path (torchrun,
    gloo ranks, console, run directory, the refused relaunch), and the loss has halved by step 20 (5.68 at step 5,
    2.30 at 20 on the CPU); learning itself is test_learning's. The 40 steps more cost ~14 s of the ~37 s launch."""
    run_dir = tmp_path / "run"
    proc = _moontrain("launch", "recipes/k3_tiny.yaml", f"train.run_dir={run_dir}", f"experts.backend={backend}",
                      f"train.steps={STEPS}", "--nproc", "2", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = from_dict(RunConfig, yaml.safe_load((run_dir / "config.yaml").read_text())).train.steps
    assert steps == STEPS and records[-1]["step"] == steps
    first, last = records[0]["loss"], records[-1]["loss"]
    # the generated corpus is highly regular text; from ~log(257) the loss must at least halve
    assert last < 0.5 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert f"step {steps}/{steps} | loss {last:.4f}" in proc.stdout
    assert "tok/s" in proc.stdout and "max maxvio" in proc.stdout
    console = proc.stdout + proc.stderr
    assert "Warning" not in console and "Traceback" not in console and "*****" not in console, console
    assert f"moontrain: checkpoints: every 1 min of training, at the end, the last 2 kept, in {run_dir}/checkpoints" \
        in proc.stdout
    assert f"  config: {run_dir}/config.yaml\n  console: {run_dir}/console.log\n" in proc.stdout
    assert f"step {STEPS}/{STEPS} | loss" in (run_dir / "console.log").read_text()
    if backend == "moonep":  # the quick start, then another optimizer in its run directory
        proc = _moontrain("launch", "recipes/k3_tiny.yaml", f"train.run_dir={run_dir}", f"train.steps={STEPS}",
                          "optim.name=muon", timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert proc.stderr == (f"moontrain: error: {run_dir} holds a run at step {STEPS} ({run_dir}/checkpoints/"
                               f"step_{STEPS:08d}) that these settings cannot continue: optim.name adamw -> muon; "
                               "start a new run with another train.run_dir=..., or set checkpoint.resume=none to start "
                               "over here (the earlier checkpoints are moved aside)\n")


def test_dry_run_full_k3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3.yaml", "--dry-run", "--nproc", "8", "--nnodes", "112", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "world 896 = dp_replicate 1 x ep 896; experts backend alltoall" in out and ": fits)" in out
    for row in ("weights", "master", "grads", "optimizer", "symmetric_heap", "receive_buffers", "activations",
                "total"):
        assert f"  {row} " in out
    total = count_params(from_dict(RunConfig, yaml.safe_load((REPO / "recipes" / "k3.yaml").read_text())).model).total
    assert abs(total - 2.8e12) / 2.8e12 < 0.02, total
    assert f"total {total / 1e12:.3f}T" in out


def test_param_counts_match_formula() -> None:
    cfg = from_dict(RunConfig, yaml.safe_load((REPO / "recipes" / "k3_small.yaml").read_text())).model
    counts = count_params(cfg)
    per_expert = 3 * cfg.expert_width * cfg.moe_intermediate_size
    assert counts.routed_experts == cfg.num_moe_layers * cfg.num_experts * per_expert
    assert counts.embedding == 2 * cfg.vocab_size * cfg.hidden_size
    assert counts.total - counts.active == cfg.num_moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default plan is this host's: the CPU one here")
def test_dry_run_plans_for_this_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3_tiny.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "compute fp32 on cpu" in out and "host memory: need ~" in out, out
    assert "H200" not in out and "step time" not in out, out


@pytest.mark.parametrize(("args", "message"), [
    (["recipes/missing.yaml"], "recipe 'recipes/missing.yaml' does not exist"),
    (["recipes/k3_tiny.yaml", "model.hiden_size=8"], "unknown key(s) model.hiden_size (did you mean model.hidden_size?)"),
    (["recipes/k3_tiny.yaml", "eval.every=5", "eval.data.path=nowhere.jsonl"],
     "eval.data.path='nowhere.jsonl': data path 'nowhere.jsonl' names no file"),
    (["recipes/k3_tiny.yaml", "data.text_field=body"],
     "data.path='{repo}/recipes/data/tiny_corpus.jsonl': text_field='body' is not a column of "
     "'{repo}/recipes/data/tiny_corpus.jsonl'; columns: ['id', 'text']"),
    (["recipes/k3_tiny.yaml", "--nproc", "3"], "world size 3 is not divisible by parallel.ep=2"),
    (["recipes/k3_tiny.yaml", "parallel.ep=4", "--nproc", "4", "model.num_experts=6",
      "model.num_experts_per_tok=2"], "model.num_experts=6 is not divisible by parallel.ep=4"),
])
def test_bad_launch_fails_before_torchrun(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", *args, "--dry-run"]) == 2
    assert message.format(repo=REPO) in capsys.readouterr().err


def test_multi_node_launch_needs_rendezvous(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3_tiny.yaml", "--nnodes", "2"]) == 2
    assert "--nnodes 2 needs --rdzv-endpoint" in capsys.readouterr().err


def test_torchrun_command() -> None:
    from moontrain.cli import torchrun_command

    single = torchrun_command("r.yaml", ["a.b=1"], nproc=8)
    assert single[1:] == ["-m", "moontrain.torchrun", "--nproc-per-node", "8", "--standalone",
                          "-m", "moontrain.trainer.worker", "r.yaml", "a.b=1"]
    multi = torchrun_command("r.yaml", [], nproc=8, nnodes=4, node_rank=2, rdzv_endpoint="h:29500", rdzv_id="job7",
                             max_restarts=3, log_dir=Path("runs/x/logs"))
    assert multi[1:] == ["-m", "moontrain.torchrun", "--nproc-per-node", "8", "--nnodes", "4", "--node-rank", "2",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29500", "--rdzv-id", "job7",
                         "--max-restarts", "3", "--log-dir", "runs/x/logs/node2", "--tee", "3",
                         "-m", "moontrain.trainer.worker", "r.yaml"]


def test_data_lines_name_each_source_and_its_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": [f"document {i} " * 20 for i in range(2000)]}).save_to_disk(str(saved))
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    corpus = REPO / "recipes/data/tiny_corpus.jsonl"
    assert main(["launch", "recipes/k3_tiny.yaml", "data.path=null", f"data.sources.web.path={saved}",
                 f"data.sources.book.path={corpus}", "data.sources.book.weight=3", "eval.every=5",
                 f"eval.data.path={corpus}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"data.sources.web: {saved} (saved, 1 file(s), {size / 2**20:.1f} MiB, weight 1)" in out, out
    assert f"data.sources.book: {corpus} (jsonl, 1 file(s), {corpus.stat().st_size / 2**20:.1f} MiB, weight 3)" in out
    assert f"eval.data: {corpus} (jsonl, 1 file(s)" in out and size >= 0.1 * 2**20, size  # printed as >= 0.1 MiB


def test_version_and_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"moontrain 0.1.0 (torch {torch.__version__}, Python ")
    from moontrain.parallel.layout import single_process_layout
    from moontrain.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = from_dict(RunConfig, load_recipe("recipes/k3_tiny.yaml", ["parallel.ep=1", "experts.backend=local",
                                                                     f"train.run_dir={tmp_path}", "train.steps=2"]))
    trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()
    second = trainer.save_checkpoint()
    (tmp_path / "checkpoints" / "step_00000003.tmp").mkdir()  # a save that did not finish
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    sizes = [sum(f.stat().st_size for f in p.iterdir()) / 1e6 for p in (first, second)]
    assert lines[0] == f"{tmp_path}/checkpoints:" and lines[1].split() == ["step", "size", "finite", "tokens", "seen",
                                                                           "digests"]
    assert lines[2].split() == ["1", f"{sizes[0]:.1f}", "MB", "yes", "512", "ok"], lines
    assert lines[3].split() == ["2", f"{sizes[1]:.1f}", "MB", "yes", "1,024", "ok"], lines
    assert lines[4].split()[0] == "00000003.tmp" and lines[4].endswith("incomplete (a save that did not finish)")
    data = second / "rank_00000.safetensors"  # one flipped byte: the digests catch it
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["checkpoints", str(tmp_path / "checkpoints")]) == 1
    bad = capsys.readouterr().out.splitlines()[3]
    assert bad.split()[:5] == ["2", f"{sizes[1]:.1f}", "MB", "yes", "1,024"] and "BAD: checkpoint file" in bad, bad
    assert f"{data} is corrupt" in bad
