"""Global-norm clipping counts every parameter exactly once across meshes: dense grads are FSDP shards
over the whole world, expert grads are local rows replicated over dp_replicate. With every dense
grad element set to 1 and every expert grad element to 2, the norm must be
sqrt(#dense + 4 * #expert) over the *unsharded, unreplicated* model, on every layout."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from moontrain.parallel.clip import clip_grad_norm_global
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.parallel.test_ep_equality import tiny_config

MAX_NORM = 0.5


def _fill_and_clip(trainer: Trainer) -> tuple[float, float, float]:
    for p in trainer.dense_params:
        p.grad = torch.ones_like(p)
    for p in trainer.expert_params:
        p.grad = torch.full_like(p, 2.0)
    norm = float(clip_grad_norm_global(trainer.dense_params, trainer.expert_params, trainer.layout, MAX_NORM))
    dense = trainer.dense_params[0].grad
    dense_value = float((dense.to_local() if isinstance(dense, DTensor) else dense).flatten()[0])
    return norm, dense_value, float(trainer.expert_params[0].grad.flatten()[0])


def _expected() -> float:
    trainer = Trainer(tiny_config("local", 1), single_process_layout(torch.device("cpu")))
    dense = sum(p.numel() for p in trainer.dense_params)
    experts = sum(p.numel() for p in trainer.expert_params)
    return math.sqrt(dense + 4 * experts)


def _rank(rank: int, world: int, ep: int) -> tuple[float, float, float]:
    trainer = Trainer(tiny_config("alltoall", ep), build_layout(ep, torch.device("cpu")))
    return _fill_and_clip(trainer)


@pytest.mark.parametrize(("world", "ep"), [(1, 1), (2, 2), (4, 2), (4, 1)], ids=["ep1", "ep2", "dp2xep2", "dp4"])
def test_global_norm_counts_each_parameter_once(world: int, ep: int) -> None:
    want = _expected()
    for rank, (norm, dense_value, expert_value) in enumerate(run_ranks(_rank, world, ep, timeout_s=300)):
        assert norm == pytest.approx(want, rel=1e-6), f"rank {rank}: norm {norm} vs {want}"
        coef = MAX_NORM / (want + 1e-6)
        assert dense_value == pytest.approx(coef, rel=1e-6) and expert_value == pytest.approx(2 * coef, rel=1e-6)


def _fold_rank(rank: int, world: int, ep: int) -> list[tuple[str, float]]:
    """One step of fused AdamW with the clip folded into the step vs the grads clipped in place,
    from the same state and grads (norm > max_norm, so clipping acts): params and exp_avg."""
    import dataclasses

    results = []
    params = {}
    for fold in (False, True):
        cfg = tiny_config("alltoall", ep)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, fused=True, write_back=False))
        trainer = Trainer(cfg, build_layout(ep, torch.device("cpu")))
        gen = torch.Generator().manual_seed(rank * 7 + 1)
        for p in trainer.dense_params + trainer.expert_params:
            local = torch.randn(_local_shape(p), generator=gen)
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements) if isinstance(p, DTensor) else local
        norm = clip_grad_norm_global(trainer.dense_params, trainer.expert_params, trainer.layout, MAX_NORM,
                                     optimizer=trainer.optimizer if fold else None)
        assert trainer.optimizer.folds_clip and hasattr(trainer.optimizer, "grad_scale") == fold
        trainer.optimizer.step()
        # exp_avg = (1 - beta1) * clipped grad: the parameters alone would not show a missing
        # scale (Adam's first update is nearly scale-invariant)
        params[fold] = [_local(t).detach().clone() for p in trainer.dense_params + trainer.expert_params
                        for t in (p, trainer.optimizer.state[p]["exp_avg"])]
        results.append(("norm", float(norm)))
    worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                for a, b in zip(params[True], params[False], strict=True))
    moved = max(float((a - b).abs().max()) for a, b in zip(params[True], params[False], strict=True))
    return [*results, ("max relative difference", worst), ("max abs difference", moved)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_shape(p: torch.Tensor) -> torch.Size:
    return p.to_local().shape if isinstance(p, DTensor) else p.shape


@pytest.mark.parametrize(("world", "ep"), [(1, 1), (2, 2)], ids=["ep1", "ep2"])
def test_clip_folded_into_fused_optimizer_step(world: int, ep: int) -> None:
    for rank, res in enumerate(run_ranks(_fold_rank, world, ep, timeout_s=300)):
        vals = dict(res[2:])
        assert res[0][1] == res[1][1] > MAX_NORM, f"rank {rank}: norms {res[:2]} (must clip)"
        # AdamW's update divides by sqrt(v): the two ways round the scaled grad differently (1 ulp),
        # and the update is lr-sized, so the params agree to a few fp32 ulps of their magnitude
        assert vals["max relative difference"] < 1e-6, f"rank {rank}: {vals}"


def test_trainer_step_clears_the_folded_clip() -> None:
    """The clip factor folded into the fused optimizer applies to its own step only."""
    import dataclasses

    cfg = tiny_config("local", 1)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, fused=True, write_back=False, grad_clip=1e-3))
    trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(float(opt.grad_scale)))
    trainer.train_step()
    assert seen and seen[0] > 1.0, f"grad_scale during the step: {seen} (the tiny clip must act)"
    assert not hasattr(trainer.optimizer, "grad_scale"), "a stale clip factor would scale the next step"
