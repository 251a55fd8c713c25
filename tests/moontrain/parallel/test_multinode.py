"""Two "nodes" on localhost: `moontrain launch --nnodes 2` twice (c10d rendezvous, one rank per node) trains
k3_tiny with the all-to-all across the nodes to the same losses, bit for bit, as one node of two ranks,
and writes per-rank logs under the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[3]
STEPS = ["train.steps=3", "train.log_every=1", "checkpoint.save_final=false", "metrics.wandb=false",
         "experts.backend=alltoall"]


def _launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "moontrain.cli", "launch", "recipes/k3_tiny.yaml",
                             f"train.run_dir={run_dir}", *STEPS, *extra], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_localhost_nodes_match_one_node(tmp_path: Path) -> None:
    one = _launch(tmp_path / "one", "--nproc", "2")
    out, _ = one.communicate(timeout=300)
    assert one.returncode == 0, out[-3000:]

    run_dir, endpoint = tmp_path / "two", f"127.0.0.1:{free_port()}"
    nodes = [_launch(run_dir, "--nproc", "1", "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", endpoint)
             for i in (0, 1)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, text in zip(nodes, outs, strict=True):
        assert node.returncode == 0, text[-3000:]
    assert _losses(run_dir) == _losses(tmp_path / "one")
    logs = sorted(p.relative_to(run_dir / "logs").parts[0] for p in (run_dir / "logs").rglob("stdout.log"))
    assert logs == ["node0", "node1"], logs
