"""Pipelined steps: Trainer.fit takes a step's host reads (its verdict, its metrics window) in the next step,
and an optimizer that skips on the device (torch's fused AdamW here, on the CPU) is stepped before the verdict
is read. Neither may change what is trained or logged.

References: the same run stepped by train_step, every read taken in its own step (bitwise states, equal
logged values); for a NaN step, the state captured before it (a skip leaves it bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain.metrics.progress import ProgressLog
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.guard import DivergenceError
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")
NAN_AT = 2  # 0-based step whose loss is NaN


def _fused(run_dir: Path, steps: int = 5, **kw) -> Trainer:
    """torch's fused AdamW (it skips on its found_inf flag); the write-back kernel needs a GPU. Heatmaps
    after steps 2, 4 and 5."""
    torch.set_num_threads(1)
    cfg = small_config("local", 1, steps=steps, run_dir=str(run_dir), **kw)
    cfg.optim.fused, cfg.optim.write_back = True, False
    cfg.metrics.heatmap_every = 2
    trainer = Trainer(cfg, single_process_layout(CPU))
    trainer.log = ProgressLog(run_dir, steps)
    assert trainer.optimizer.skips_on_device
    return trainer


def _poison_at(trainer: Trainer, step: int) -> None:
    """The loss of 0-based step `step` is NaN (every gradient follows)."""
    def hook(module, args, out):
        return (out[0] * float("nan"), out[1]) if trainer.step == step else out

    trainer.model.register_forward_hook(hook)


def test_fused_adamw_skips_a_nan_step_on_the_device(tmp_path: Path) -> None:
    trainer = _fused(tmp_path)
    train(trainer, NAN_AT)
    before = full_state(trainer)
    _poison_at(trainer, NAN_AT)
    logged = trainer.train_step()
    assert trainer.guard.total == 1 and logged.scalars["skipped_steps"] == 1.0
    assert_bitwise(full_state(trainer), before, "after a NaN step skipped on the device")
    logged = trainer.train_step()
    assert trainer.guard.consecutive == 0 and logged.loss == logged.loss


def test_fit_pipelined_equals_step_by_step(tmp_path: Path) -> None:
    """fit (reads one step late, a NaN step among them) against train_step (reads at once): the same
    states, logged values and heatmaps."""
    runs, pngs = [], []
    for pipelined in (True, False):
        trainer = _fused(tmp_path / str(pipelined))
        _poison_at(trainer, NAN_AT)
        if pipelined:
            stats = trainer.fit()
            assert not trainer._deferred
        else:
            stats = [trainer.train_step() for _ in range(5)]
        assert [s.step for s in stats] == [1, 2, 3, 4, 5] and trainer.guard.total == 1
        runs.append(([(s.loss, s.grad_norm, s.max_maxvio, s.scalars["skipped_steps"]) for s in stats],
                     full_state(trainer)))
        pngs.append({p.name: p.read_bytes() for p in (tmp_path / str(pipelined) / "heatmaps").iterdir()})
        trainer.log.close()
        trainer.close()
    (fit_logs, fit_state), (step_logs, step_state) = runs
    assert [v[3] for v in fit_logs] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert fit_logs[:NAN_AT] + fit_logs[NAN_AT + 1:] == step_logs[:NAN_AT] + step_logs[NAN_AT + 1:]
    (loss, norm, *_), (ref_loss, ref_norm, *_) = fit_logs[NAN_AT], step_logs[NAN_AT]
    assert loss == ref_loss and norm != norm and ref_norm != ref_norm  # the skipped step's norm: NaN in both
    assert_bitwise(fit_state, step_state, "fit (pipelined) vs train_step")
    assert sorted(pngs[0]) == [f"expert_load_step_0000000{i}.png" for i in (2, 4, 5)] and pngs[0] == pngs[1]


def test_deferred_divergence_stops_the_run(tmp_path: Path) -> None:
    """max_skipped_steps NaN steps in a row stop a pipelined fit with DivergenceError; the trained state is
    the one before the first of them."""
    trainer = _fused(tmp_path, steps=8)
    trainer.guard.max_skipped_steps = 2
    train(trainer, 2)
    before = full_state(trainer)
    trainer.model.register_forward_hook(lambda m, args, out: (out[0] * float("nan"), out[1]))
    with pytest.raises(DivergenceError, match=r"2 consecutive steps \(up to step 4\)"):
        trainer.fit()
    assert trainer.guard.total == 2
    assert_bitwise({k: v for k, v in full_state(trainer).items() if not k.startswith("router_bias")},
                   {k: v for k, v in before.items() if not k.startswith("router_bias")}, "after the skips")


def _fsdp_pipelined_vs_step_by_step(rank: int, world: int, run_dir: str) -> None:
    """FSDP2 dense params (DTensors) and 2-way moonep experts, fused AdamW skipping on the device: fit against
    train_step, a NaN step among them; bitwise equal states on every rank."""
    from moontrain.parallel.layout import build_layout

    states = []
    for pipelined in (True, False):
        cfg = small_config("moonep", 2, steps=4, run_dir=f"{run_dir}/{pipelined}")
        cfg.optim.fused, cfg.optim.write_back = True, False
        trainer = Trainer(cfg, build_layout(world, CPU))
        assert trainer.fsdp and trainer.optimizer.skips_on_device
        _poison_at(trainer, NAN_AT)
        stats = trainer.fit() if pipelined else [trainer.train_step() for _ in range(4)]
        assert [s.step for s in stats] == [1, 2, 3, 4] and trainer.guard.total == 1
        states.append(full_state(trainer))
        trainer.close()
    bad = [k for k, v in states[0].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not bad, f"rank {rank}: the NaN step reached {bad[:3]}"
    assert_bitwise(states[0], states[1], f"rank {rank}: fit (pipelined) vs train_step, FSDP2")


def test_fsdp_pipelined_equals_step_by_step(tmp_path: Path) -> None:
    run_ranks(_fsdp_pipelined_vs_step_by_step, 2, str(tmp_path))
