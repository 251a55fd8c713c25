"""AdamW parameter groups and the learning-rate schedules, against hand-computed values; the optimizer
contract of the training step (moontrain/optim/protocol.py) against torch's AdamW on pre-divided grads."""

from __future__ import annotations

import math

import pytest
import torch

from moontrain.model.config import ModelConfig
from moontrain.model.transformer import K3Model
from moontrain.optim.adamw import build_optimizer, split_param_groups
from moontrain.optim.config import OptimConfig
from moontrain.optim.protocol import TrainOptimizer
from moontrain.optim.schedule import lr_multiplier


def _model() -> K3Model:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, dense_intermediate_size=64, num_heads=2,
                      q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                      num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=64,
                      moe_latent_size=None)
    return K3Model(cfg)


def test_param_groups() -> None:
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {k: sorted(names[id(p)] for p in v) for k, v in split_param_groups(model).items()}
    assert all(n.endswith("norm.weight") or n == "embed.weight" for n in groups["no_decay"])
    assert "embed.weight" in groups["no_decay"] and "layers.0.attn_norm.weight" in groups["no_decay"]
    assert groups["experts"] == ["layers.1.ffn.experts.master.down", "layers.1.ffn.experts.master.gate_up"]
    assert "lm_head.weight" in groups["decay"] and "layers.1.ffn.router.weight" in groups["decay"]
    assert sum(map(len, groups.values())) == len(names)
    opt, _ = build_optimizer(model, OptimConfig(weight_decay=0.1), total_steps=10)
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups} == {"decay": 0.1, "no_decay": 0.0, "experts": 0.1}


def test_cosine_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, cfg, 20) == pytest.approx(1.0)
    assert lr_multiplier(12, cfg, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(20, cfg, 20) == pytest.approx(0.1)


def test_wsd_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="wsd", decay_fraction=0.25, min_lr_ratio=0.0)
    got = [lr_multiplier(s, cfg, 20) for s in range(21)]
    assert got[:2] == [0.5, 1.0] and all(v == 1.0 for v in got[2:15])
    assert got[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


def test_scheduler_drives_optimizer_lr() -> None:
    model = _model()
    opt, sched = build_optimizer(model, OptimConfig(lr=2.0, warmup_steps=2, schedule="constant"), total_steps=5)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [1.0, 2.0, 2.0]


def test_bad_optim_config() -> None:
    with pytest.raises(ValueError, match=r"optim\.min_lr_ratio must be in \[0, 1\], got 2\.0"):
        OptimConfig(min_lr_ratio=2.0)
    with pytest.raises(ValueError, match=r"optim\.lr must be a finite number > 0, got 0\.0"):
        OptimConfig(lr=0.0)


def test_write_back_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"optim\.write_back=true runs a Triton kernel"):
        build_optimizer(_model(), OptimConfig(write_back=True), total_steps=10)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_muon_keeps_the_step_contract(fused: bool) -> None:
    """Muon never folds the clip (its fused AdamW groups would take a grad_scale, its Muon groups not):
    the clip scales the grads in place instead."""
    opt, _ = build_optimizer(_model(), OptimConfig(name="muon", fused=fused, write_back=False), total_steps=10)
    assert isinstance(opt, TrainOptimizer) and not opt.folds_clip and opt.written_back == frozenset()
    with pytest.raises(ValueError, match="Muon does not fold the gradient clip"):
        opt.clip_next_step(torch.tensor(2.0))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_optimizer_keeps_the_step_contract(fused: bool) -> None:
    """build_optimizer's optimizer is a TrainOptimizer; a fused one divides the grads of the next step
    (only) by the clip factor: bitwise torch's fused AdamW stepped on grads divided beforehand."""
    torch.manual_seed(0)
    model = _model()
    model.init_weights(0)
    opt, _ = build_optimizer(model, OptimConfig(fused=fused, write_back=False), total_steps=10)
    assert isinstance(opt, TrainOptimizer) and opt.folds_clip == fused and opt.written_back == frozenset()
    if not fused:
        with pytest.raises(ValueError, match="clip_next_step needs a fused optimizer"):
            opt.clip_next_step(torch.tensor(2.0))
        return
    ref_model = _model()
    ref_model.load_state_dict(model.state_dict())
    ref, _ = build_optimizer(ref_model, OptimConfig(fused=True, write_back=False), total_steps=10)
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    for factor in (4.0, None):
        grads = [torch.randn_like(p) for p in params]
        for p, r, g in zip(params, ref_params, grads, strict=True):
            p.grad = g.clone()
            r.grad = g / factor if factor is not None else g.clone()
        if factor is not None:
            opt.clip_next_step(torch.tensor(factor))
        opt.step()
        ref.step()
        assert not hasattr(opt, "grad_scale"), "the clip factor outlived its step"
        for p, r in zip(params, ref_params, strict=True):
            assert torch.equal(p, r), f"step with clip factor {factor}: parameters differ"
