"""The dry-run's view of hierarchical EP (parallel.ep_hosts): the host Buffer's sizes, the host stage's static
rows in the activations, and the network traffic over ep_hosts hosts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from moonep import BufferConfig, Layout
from moontrain.cli import main
from moontrain.config import RunConfig, from_dict
from moontrain.model.params import count_params
from moontrain.planning.memory import estimate_memory
from moontrain.planning.step_time import StepTimeAssumptions, predict_step_time

REPO = Path(__file__).resolve().parents[3]


def _k3(**parallel) -> RunConfig:
    raw = yaml.safe_load((REPO / "recipes" / "k3.yaml").read_text())
    raw["experts"]["backend"] = "moonep"
    raw["parallel"].update(parallel)
    return from_dict(RunConfig, raw)


def test_memory_of_the_host_stage() -> None:
    world, N = 896, 112
    flat, hier = _k3(), _k3(ep_hosts=N)
    counts = count_params(flat.model)
    m, S = flat.model, flat.train.micro_batch(world) * flat.train.seq_len
    one, two = estimate_memory(flat, counts, world, 2), estimate_memory(hier, counts, world, 2)
    host = Layout(BufferConfig(max_tokens=N * S, hidden=m.expert_width, topk=m.num_experts_per_tok,
                               num_experts=m.num_experts // N, dtype=torch.bfloat16, entries=True), 896 // N)
    assert two.experts["receive_buffers"] == host.comm_bytes > 100 * one.experts["receive_buffers"]
    assert two.experts["symmetric_heap"] == one.experts["symmetric_heap"]  # the same epn slots
    assert two.dense["activations"] > one.dense["activations"]  # the host stage's static expert rows
    for name in ("weights", "master", "grads", "optimizer"):
        assert two.experts[name] == one.experts[name]


def test_network_over_ep_hosts_is_the_all_to_all_model() -> None:
    a = StepTimeAssumptions()
    alltoall = dataclasses.replace(_k3(), experts=dataclasses.replace(_k3().experts, backend="alltoall"))
    hier = predict_step_time(_k3(ep_hosts=112), 896, a)
    assert hier.network_bytes > 0
    assert hier.network_bytes == pytest.approx(predict_step_time(alltoall, 896, a).network_bytes)
    assert predict_step_time(_k3(), 896, a).network_bytes == 0


def test_dry_run_names_the_hierarchical_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3_small_moe.yaml", "--dry-run", "--device", "cuda", "--nproc", "8", "--nnodes", "2",
                 "parallel.ep=16", "parallel.ep_hosts=2", "train.micro_batch_size=2"]) == 0
    assert "hierarchical EP: the EP group spans 2 hosts of 8 ranks" in capsys.readouterr().out
    assert main(["launch", "recipes/k3_small_moe.yaml", "--dry-run", "--device", "cuda", "--nproc", "4", "--nnodes", "4",
                 "parallel.ep=16", "parallel.ep_hosts=2", "train.micro_batch_size=2"]) == 2
    assert "puts 8 ranks of the EP group on each host" in capsys.readouterr().err
