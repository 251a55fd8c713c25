"""The dry run's dense rows follow parallel.dense: FSDP splits the fp32 masters, grads and Adam moments of
the P dense parameters over the world and holds compute-dtype copies of the root and two blocks; allreduce
holds all P in fp32 on every rank (no copies); the expert rows and the activations do not depend on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moontrain.cli import main
from moontrain.config import RunConfig, from_dict
from moontrain.model.params import count_params
from moontrain.planning.memory import estimate_memory

REPO = Path(__file__).resolve().parents[3]
WORLD, BF16 = 4, 2


def _k3_small(dense: str) -> RunConfig:
    raw = yaml.safe_load((REPO / "recipes" / "k3_small.yaml").read_text())
    raw["parallel"]["dense"] = dense
    raw["optim"]["state_dtype"] = "float32"  # fp32 moments: 8 bytes a parameter (the bf16 case is its own test)
    return from_dict(RunConfig, raw)


def test_dense_rows_follow_parallel_dense() -> None:
    counts = count_params(_k3_small("fsdp").model)
    P = counts.dense
    fsdp = estimate_memory(_k3_small("fsdp"), counts, WORLD, BF16)
    allreduce = estimate_memory(_k3_small("allreduce"), counts, WORLD, BF16)
    block = counts.max_block_dense(_k3_small("fsdp").model)
    assert fsdp.dense["weights"] == (counts.embedding + 2 * block) * BF16
    assert (fsdp.dense["master"], fsdp.dense["optimizer"]) == (4 * P / WORLD, 8 * P / WORLD)
    assert fsdp.dense["grads"] == 4 * P / WORLD + 2 * block * BF16
    assert allreduce.dense["weights"] == 0
    assert (allreduce.dense["master"], allreduce.dense["grads"], allreduce.dense["optimizer"]) == (4 * P, 4 * P, 8 * P)
    assert allreduce.experts == fsdp.experts
    assert allreduce.dense["activations"] == fsdp.dense["activations"]


@pytest.mark.parametrize(("dense", "line"), [("fsdp", "dense params: FSDP2 over 2 ranks"),
                                             ("allreduce", "dense params: fp32 on every rank, grads all-reduced")])
def test_the_dry_run_names_the_dense_layout(dense: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "recipes/k3_tiny.yaml", f"parallel.dense={dense}", "--dry-run", "--device", "cpu"]) == 0
    assert line in capsys.readouterr().out


def test_bf16_moments_halve_the_optimizer_rows() -> None:
    """optim.state_dtype=bfloat16: Adam's two moments at 2 bytes each, dense and expert rows; nothing else moves."""
    fp32, bf16 = _k3_small("fsdp"), _k3_small("fsdp")
    bf16.optim.state_dtype = "bfloat16"
    counts = count_params(fp32.model)
    a, b = estimate_memory(fp32, counts, WORLD, BF16), estimate_memory(bf16, counts, WORLD, BF16)
    assert b.dense["optimizer"] == 4 * counts.dense / WORLD == a.dense["optimizer"] / 2
    assert b.experts["optimizer"] == a.experts["optimizer"] / 2 > 0
    assert {k: v for k, v in b.dense.items() if k != "optimizer"} == {k: v for k, v in a.dense.items() if k != "optimizer"}


@pytest.mark.parametrize(("accumulate", "compute_bytes", "scratch"), [
    ("auto", 2, False), ("triton", 2, False), ("torch", 2, True), ("auto", 4, True)])
def test_plain_dense_grads_hold_a_bounded_scratch_only_for_the_foreach_adds(accumulate: str, compute_bytes: int,
                                                                           scratch: bool) -> None:
    """parallel.dense=plain at one rank: the fp32 accumulators; from a step's second pass on, the foreach adds
    widen grads into one fp32 scratch of the largest dense tensor (k3_small's embedding, V x D; at least
    plain_dense.SCRATCH_BYTES), which the Triton accumulator (auto on a GPU's bf16 run) does without. (A pass's
    compute-dtype grads exist only in its backward: the activations row counts them there.)"""
    from moontrain.parallel.plain_dense import SCRATCH_BYTES

    one, eight = _k3_small("plain"), _k3_small("plain")
    for cfg in (one, eight):
        cfg.parallel.plain_accumulate = accumulate
    eight.train.global_batch_size, eight.train.micro_batch_size = 32, 4
    counts = count_params(one.model)
    P, V, D = counts.dense, one.model.vocab_size, one.model.hidden_size
    single = estimate_memory(one, counts, 1, compute_bytes).dense["grads"]
    assert single == 4 * P
    extra = max(4 * V * D, SCRATCH_BYTES) if scratch else 0
    assert estimate_memory(eight, counts, 1, compute_bytes).dense["grads"] == single + extra
