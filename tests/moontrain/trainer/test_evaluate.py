"""Evaluation: the held-out loss is the mean cross-entropy of the first eval.steps x G rows of the held-out
data packed in file order (checked against rows packed here from the corpus and a plain forward), the same
at one process, EP = 2 (moonep) and DP = 2 within the fp32 reorder tolerance, and evaluating between steps
leaves training bitwise unchanged (no router counts, no gathered FSDP blocks left behind). One pair of
spawned ranks runs every multi-process case.

Tolerance: as in test_ep_equality: the single-process value recomputed with the rows of every batch
reversed gives the fp32 summation-order noise; layouts must agree within 20x that, floor 1e-5 relative.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from moontrain.config import RunConfig, from_dict
from moontrain.config.eval_config import EvalConfig
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import small_config

REPO = Path(__file__).resolve().parents[3]
CORPUS = str(REPO / "recipes" / "data" / "tiny_corpus.jsonl")
EVAL = {"every": 1, "steps": 2, "data": {"path": CORPUS}}
T, G = 16, 4


def _config(backend: str, ep: int, *, evaluate: bool = True, reshard: bool = True) -> RunConfig:
    cfg = small_config(backend, ep, steps=3, data={"source": "dataset", "path": CORPUS})
    cfg.eval = from_dict(EvalConfig, EVAL if evaluate else {}, "eval")
    cfg.parallel.fsdp_reshard_after_forward = reshard
    return cfg


def _packed_rows() -> torch.Tensor:
    """The first steps x G rows of the corpus packed in file order, bytes + EOS 256 (the reference)."""
    stream: list[int] = []
    for line in Path(CORPUS).read_text().splitlines():
        stream += [*json.loads(line)["text"].encode(), 256]
        if len(stream) > EVAL["steps"] * G * T + 1:
            break
    t = torch.tensor(stream[:EVAL["steps"] * G * T + 1])
    return t.unfold(0, T + 1, T)


def _reference(trainer: Trainer, reverse: bool) -> float:
    rows = _packed_rows()
    total = 0.0
    with torch.no_grad():
        for batch in rows.view(EVAL["steps"], G, T + 1):
            batch = batch.flip(0) if reverse else batch
            _, ce = trainer.model(batch[:, :-1], batch[:, 1:])
            total += ce.double().item() * G * T
    return total / (EVAL["steps"] * G * T)


def _two_ranks(rank: int, world: int) -> dict[str, object]:
    """EP = 2 (moonep) and DP = 2 (local experts) evaluations at init; 3 EP = 2 steps with and without eval."""
    out: dict[str, object] = {}
    for name, backend, ep in (("ep2", "moonep", 2), ("dp2", "local", 1)):
        trainer = Trainer(_config(backend, ep), build_layout(ep, torch.device("cpu")))
        try:
            out[name] = trainer.evaluator.run()["eval/loss"]
        finally:
            trainer.close()
    layout = build_layout(2, torch.device("cpu"))
    for evaluate in (True, False):
        trainer = Trainer(_config("moonep", 2, evaluate=evaluate, reshard=False), layout)
        try:
            stats = [trainer.train_step() for _ in range(3)]
        finally:
            trainer.close()
        out[f"losses_eval_{evaluate}"] = [s.loss for s in stats]
        if evaluate:
            out["evals"] = [s.scalars["eval/loss"] for s in stats]
    return out


def test_eval_loss_is_the_same_at_every_layout_and_leaves_training_unchanged() -> None:
    trainer = Trainer(_config("local", 1), single_process_layout(torch.device("cpu")))
    got = trainer.evaluator.run()
    ref, reordered = _reference(trainer, False), _reference(trainer, True)
    tol = max(20 * abs(ref - reordered), 1e-5 * abs(ref))
    assert abs(got["eval/loss"] - ref) <= tol, (got, ref, tol)
    assert got["eval/ppl"] == pytest.approx(math.exp(got["eval/loss"]), rel=1e-12)
    assert trainer.evaluator.run()["eval/loss"] == got["eval/loss"], "the same rows, the same weights"
    ranks = run_ranks(_two_ranks, 2, timeout_s=600)
    for layout in ("ep2", "dp2"):
        assert ranks[0][layout] == ranks[1][layout], layout
        assert abs(ranks[0][layout] - ref) <= tol, (layout, ranks[0][layout], ref, tol)
    out = ranks[0]
    assert out["losses_eval_True"] == out["losses_eval_False"], "evaluating between steps changed training"
    evals = out["evals"]
    assert evals[2] < evals[0], f"the held-out loss did not fall: {evals}"


def test_eval_config_errors() -> None:
    with pytest.raises(ValueError, match=re.escape("eval.every=5 needs held-out data: eval.data.path=FILE")):
        EvalConfig(every=5)
    with pytest.raises(ValueError, match=re.escape("eval.every=3 is not a multiple of train.log_every=2")):
        from_dict(RunConfig, {**_raw(), "eval": {"every": 3, "data": {"path": CORPUS}}})


def _raw() -> dict:
    import yaml

    raw = yaml.safe_load((REPO / "recipes" / "k3_tiny.yaml").read_text())
    raw["train"]["log_every"] = 2
    return raw
