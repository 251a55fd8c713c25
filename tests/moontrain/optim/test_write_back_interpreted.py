"""WriteBackAdamW's fused expert step in Triton's interpreter on the CPU, against torch's AdamW
(tests/moontrain/optim/write_back_cases.py)."""

from __future__ import annotations

import pytest

# first: sets TRITON_INTERPRET=1 before triton is imported and skips this module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from tests.moontrain.optim.write_back_cases import (
    check_write_back_bf16_moments,
    check_write_back_many_tensors,
    check_write_back_matches_adamw,
    check_write_back_skips_on_the_flag,
)


def test_write_back_adamw_matches_torch_adamw() -> None:
    check_write_back_matches_adamw("cpu", fused=None, exact_rounding=False, torch_param=True, clip=False)


def test_write_back_adamw_applies_the_clip_factor() -> None:
    check_write_back_matches_adamw("cpu", fused=None, exact_rounding=False, torch_param=False, clip=True)


def test_write_back_adamw_skips_on_the_device_flag() -> None:
    check_write_back_skips_on_the_flag("cpu", fused=None)


def test_write_back_steps_many_tensors_in_one_launch() -> None:
    check_write_back_many_tensors("cpu", exact_rounding=False)


def test_write_back_rejects_mismatched_target() -> None:
    import torch

    from moontrain.optim.write_back import WriteBackAdamW

    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = WriteBackAdamW([p], lr=1e-3)
    with pytest.raises(ValueError, match="does not match parameter"):
        opt.register_write_back(p, torch.zeros(6, 4).t())
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        WriteBackAdamW([p], lr=1e-3, amsgrad=True)
    from moontrain.optim.write_back_kernel import adamw_write_back_

    flat = torch.zeros(5, 8)
    q = flat.view(-1)[1:9]  # 4 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match=r"entries \[0\] start off a 16-byte boundary"):
        adamw_write_back_([q], [q.clone()], [q.clone()], [q.clone()], [torch.zeros(())], [q.clone()], lr=1e-3,
                          beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def test_trainer_with_write_back_matches_plain_adamw(tmp_path) -> None:
    """The trainer's step protocol with optim.write_back (one fused pass per expert projection, then
    finish_step skips them) against torch's AdamW + push_master + zero_grads: same losses and state
    within the kernel's fp32 contraction (bound as in write_back_cases), compute copies = masters."""
    import torch

    from moontrain.optim.write_back import WriteBackAdamW
    from moontrain.parallel.layout import single_process_layout
    from moontrain.trainer.trainer import Trainer
    from tests.moontrain.ckpt_utils import full_state, small_config, train

    states, losses = [], []
    for write_back in (False, True):
        cfg = small_config("local", 1, run_dir=str(tmp_path / str(write_back)))
        cfg.optim.write_back = write_back
        trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
        assert isinstance(trainer.optimizer, WriteBackAdamW) == write_back
        losses.append(train(trainer, 4))
        states.append(full_state(trainer))
        for w in trainer.experts:
            for name, master in w.master.items():
                assert torch.equal(w.compute[name], master.detach().to(w.compute[name].dtype))
                assert master.grad is None and not w.grad[name].any()
        if write_back:
            assert len(trainer.optimizer.written_back) == 2 * len(trainer.experts)  # gate_up and down
        trainer.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, ref in states[0].items():
        tol = 1e-6 * (float(ref.abs().max()) + 1.0)
        torch.testing.assert_close(states[1][name], ref, rtol=0, atol=tol, msg=name)


def _train_moonep(rank: int, world: int, write_back: bool, run_dir: str) -> tuple[list[float], dict]:
    import torch

    from moontrain.parallel.layout import build_layout
    from moontrain.trainer.trainer import Trainer
    from tests.moontrain.ckpt_utils import full_state, small_config, train

    torch.set_num_threads(1)
    cfg = small_config("moonep", 2, run_dir=run_dir)
    cfg.optim.write_back = write_back
    trainer = Trainer(cfg, build_layout(2, torch.device("cpu")))
    losses = train(trainer, 4)
    state = full_state(trainer)
    written = len(trainer.optimizer.written_back) if write_back else 0
    trainer.close()
    return losses, {**state, "written": torch.tensor(written)}


def test_moonep_trainer_with_write_back_matches_plain_adamw(tmp_path) -> None:
    """moonep at EP=2 (gloo): WriteBackAdamW registers the expert masters with zero_grad=False and
    moonep declares their grads zero instead (ExpertPools.defer_zero_grads, overwritten by the next
    accumulation): 4 steps match torch's AdamW + push_master + zeroing within the kernel's rounding
    (a grad left stale would add a whole step's gradient)."""
    import torch

    from tests.dist_utils import run_ranks

    ref_losses, ref = run_ranks(_train_moonep, 2, False, str(tmp_path / "a"), timeout_s=300)[0]
    losses, got = run_ranks(_train_moonep, 2, True, str(tmp_path / "b"), timeout_s=300)[0]
    assert int(got.pop("written")) == 2 * 2  # 2 MoE layers x 2 projections (gate_up, down) of this rank
    ref.pop("written")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, want in ref.items():
        tol = 1e-6 * (float(want.abs().max()) + 1.0)
        torch.testing.assert_close(got[name], want, rtol=0, atol=tol, msg=name)


def test_trainer_writes_the_dense_copies_back(tmp_path) -> None:
    """optim.write_back_dense with parallel.dense=plain in bf16 (Triton's interpreter): the step writes every
    dense master's compute copy, so the next forward casts only the masters changed after it (QK-Clip's
    rescaled query/key weights and the mean-free router rows, found by their version counters) and, after a
    checkpoint load, all of them.
    The copies the step wrote are the masters within one bf16 ulp (the interpreter truncates where a GPU rounds
    to nearest even, as torch's cast does: equal there, test_plain_dense_gpu); the ones cast again are
    bitwise the cast. Against the same run with the dense masters on torch's AdamW and cast each step: the
    losses agree to 2e-2 relative (bf16 copies one ulp apart over 4 steps; a missed or stale copy, a step
    lost or an undecayed master is a whole update away, lr 3e-3 on weights of ~0.02)."""
    import dataclasses

    import torch

    from moontrain.parallel.layout import single_process_layout
    from moontrain.trainer.trainer import Trainer
    from tests.moontrain.ckpt_utils import small_config, train

    losses = {}
    for dense_wb in (False, True):
        cfg = small_config("local", 1, run_dir=str(tmp_path / str(dense_wb)))
        cfg = dataclasses.replace(
            cfg, parallel=dataclasses.replace(cfg.parallel, dense="plain", compute_dtype="bfloat16"),
            optim=dataclasses.replace(cfg.optim, write_back=True, write_back_dense=dense_wb, qk_clip_tau=0.03))
        trainer = Trainer(cfg, single_process_layout(torch.device("cpu")))
        pd = trainer.plain_dense
        try:
            losses[dense_wb] = train(trainer, 3)
            masters = {id(m) for m in pd.masters}
            assert (masters <= trainer.optimizer.written_back) == dense_wb
            stale = pd.stale()
            if not dense_wb:
                assert stale == list(range(len(pd.masters))), "torch's step moves every master: all cast again"
                continue
            moved = [i for i, m in enumerate(pd.masters) if any(m is w for w in _moved_after_step(trainer))]
            assert stale and set(stale) <= set(moved), f"only masters moved after the step are cast, got {stale}"
            written = [i for i in range(len(pd.masters)) if i not in stale]
            for i in written:
                want = pd.masters[i].detach().to(torch.bfloat16).float()
                assert bool(((pd.compute[i].float() - want).abs() <= want.abs() * 2.0**-7).all())
            pd.unshard()
            for i in stale:
                assert torch.equal(pd.compute[i], pd.masters[i].detach().to(torch.bfloat16))
            pd.reshard()
            assert pd.stale() == []
            path = trainer.save_checkpoint()
            trainer.load_checkpoint(path)
            assert pd.stale() == list(range(len(pd.masters))), "after a load every copy is cast again"
            losses[dense_wb].append(train(trainer, 1)[0])
        finally:
            trainer.close()
    assert losses[True][:3] == pytest.approx(losses[False], rel=2e-2)


def _moved_after_step(trainer) -> list:
    """The parameters changed in place after the optimizer's write-back: QK-Clip's (the softmax layers'
    projections) and the router rows the mean-free update restores (moontrain.model.router_updates)."""
    return ([p for attn in trainer.qk_clip.attns for p in attn.parameters()]
            + [r.weight for r in trainer.router_updates.routers])


def test_write_back_with_bf16_moments_matches_its_specification() -> None:
    check_write_back_bf16_moments("cpu")
