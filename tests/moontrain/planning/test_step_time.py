"""The dry-run's step-time prediction: remote hosts per token against a sampled routing, the totals against
the cost model written out by hand, and the report's lines for recipes/k3.yaml."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from moontrain.cli import main
from moontrain.config import RunConfig, from_dict
from moontrain.metrics.flops import flops_per_token
from moontrain.planning.step_time import StepTimeAssumptions, predict_step_time, remote_hosts_per_token

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("hosts", "experts", "topk"), [(112, 896, 16), (4, 64, 8), (16, 128, 2)])
def test_remote_hosts_match_sampled_routing(hosts: int, experts: int, topk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 20000
    picks = torch.rand(n, experts, generator=gen).argsort(dim=1)[:, :topk]  # K distinct experts per token
    host = picks // (experts // hosts)
    own = torch.randint(0, hosts, (n, 1), generator=gen)
    hit = torch.zeros(n, hosts, dtype=torch.bool).scatter_(1, host, True)
    remote = (hit.sum(1) - hit.gather(1, own).squeeze(1).long()).double().mean().item()
    want = remote_hosts_per_token(hosts, experts, topk, groups=1, top_groups=1)
    assert abs(remote - want) < 4 * (topk / n) ** 0.5, (remote, want)


def test_group_limited_routing_caps_remote_hosts() -> None:
    assert remote_hosts_per_token(112, 896, 16, groups=112, top_groups=4) == 4.0
    assert remote_hosts_per_token(1, 896, 16, groups=1, top_groups=1) == 0.0


def test_prediction_is_the_cost_model() -> None:
    cfg = from_dict(RunConfig, yaml.safe_load((REPO / "recipes" / "k3.yaml").read_text()))
    world, a = 896, StepTimeAssumptions()
    p = predict_step_time(cfg, world, a)
    m, tokens = cfg.model, cfg.train.global_batch_size // world * cfg.train.seq_len
    assert p.compute_s == pytest.approx(flops_per_token(m, cfg.train.seq_len) * tokens * 4 / 3 / (989e12 * 0.356))
    remote = remote_hosts_per_token(112, 896, 16, 1, 1)
    assert p.network_bytes == pytest.approx(tokens * remote * m.expert_width * 2 * 2 * 3 * m.num_moe_layers)
    assert p.network_s == pytest.approx(p.network_bytes / 50e9)
    moonep = dataclasses.replace(cfg, experts=dataclasses.replace(cfg.experts, backend="moonep"))
    assert predict_step_time(moonep, world, a).network_bytes == 0  # moonep's group stays inside a host


def test_dry_run_prints_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3.yaml", "--dry-run", "--nproc", "8", "--nnodes", "112", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "== step time (prediction; docs/scale.md) ==" in out and "50 GB/s per GPU between hosts (assumed)" in out
    assert "host memory" not in out  # a GPU dry-run plans GPUs, not this host
