"""check_determinism.py --profile: benchmarks/diagnostics/profile_determinism.py run in-process on the CPU (one gloo rank,
a tiny model: the steps, the timing and the JSON; the kernel lists are empty off the GPU), and the kernel
and class arithmetic of the comparison on hand-made profiles (exact values)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from benchmarks.check_determinism import compare_profiles
from benchmarks.diagnostics.profile_determinism import class_totals, kernel_totals, main
from tests.moontrain.trainer.test_determinism import restore_switches  # noqa: F401 (fixture)


def test_kernel_totals_and_comparison() -> None:
    flex = "triton_tem_fused_1"  # inductor's name for a flex_attention template kernel
    events = [(7, 0, 3000, flex), (7, 5, 1000, flex), (7, 9, 500, "nvjet_gemm"), (7, 9, 250, "x_kernel")]
    det_rows = kernel_totals(events)
    assert [(r["name"], r["class"], r["count"], r["total_us"]) for r in det_rows] == [
        (flex, "attention", 2, 4.0), ("nvjet_gemm", "gemm", 1, 0.5), ("x_kernel", "triton other", 1, 0.25)]
    default_rows = kernel_totals([(7, 0, 2000, "cudnn_fmha_bwd"), (7, 1, 600, "nvjet_gemm")])
    det = {"step_time_s": 1.1, "classes": class_totals(det_rows), "kernels": det_rows}
    default = {"step_time_s": 1.0, "classes": class_totals(default_rows), "kernels": default_rows}
    c = compare_profiles(default, det, top=3)
    assert c["deterministic_cost"] == pytest.approx(0.1)
    assert [(r["name"], r["default_ms"], r["deterministic_ms"]) for r in c["kernels"]] == [
        (flex, 0.0, 0.004), ("cudnn_fmha_bwd", 0.002, 0.0), ("x_kernel", 0.0, 0.00025)]  # largest |delta| first
    assert [(r["class"], round(r["delta_ms"], 9)) for r in c["classes"]] == [
        ("attention", 0.002), ("triton other", 0.00025), ("gemm", -0.0001)]  # largest increase first


def test_profile_script_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        restore_switches: None) -> None:  # noqa: F811
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "p.json"
    overrides = ["parallel.ep=1", "experts.backend=local", "data.source=markov", "train.seq_len=16",
                 "train.global_batch_size=2", "train.steps=4", f"train.run_dir={tmp_path}", "metrics.wandb=false",
                 "train.deterministic=true"]
    assert main(["--out", str(out), "--warmup", "1", "--steps", "2", "recipes/k3_tiny.yaml", *overrides]) == 0
    assert not dist.is_initialized()
    result = json.loads(out.read_text())
    assert result["deterministic"] is True and result["kernels"] == [] and result["classes"] == {}
    assert 0 < result["step_time_s"] and 0 < result["profiled_step_s"]
