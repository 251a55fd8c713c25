"""optim.state_dtype=bfloat16: AdamW with bf16 moments (moontrain.optim.torch_adamw), on the CPU.

- One step is the specification exactly: m and v are the fp32 formula on the widened moments, rounded to
  nearest once (bitwise), and the parameter moves by the fp32 formula on those fp32 values.
- Against torch's AdamW with fp32 moments over 20 steps: the moments differ only by the roundings. Each step's
  rounding is within 2^-9 of the moment and earlier ones decay by beta1 a step, so |m - m32| <= 2^-9 max|m| /
  (1 - beta1) = 10 * 2^-9 of the element's largest |m| so far (v: 20 * 2^-9 at beta2 = 0.95, half of it
  through the square root), so the update lr m^ / (sqrt(v^) + eps) moves by at most (10 + 10) * 2^-9 of its
  size, lr times the ratio m^ / sqrt(v^) (below 4 at these grads): |p - p32| <= N * 20 * 2^-9 * 4 lr over N
  steps. A missed bias correction or decay moves p by ~lr a step, far outside.
- The clip factor and the skip flag on the device (the hooks the training step needs) act as in torch's fused
  AdamW; the trainer runs with bf16 moments, keeps them bf16 through a checkpoint, resumes bitwise, and reads
  an fp32-moment checkpoint into bf16 moments (and back); config errors name the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain.optim.config import OptimConfig
from moontrain.optim.torch_adamw import AdamW
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8
CPU = torch.device("cpu")


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.05 for s in ((6, 40), (33,))]


def test_one_step_is_the_specification_bitwise() -> None:
    init = _params()
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    opt = AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2):
        before = {id(p): (p.detach().clone(), *(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")))
                  if opt.state[p] else None for p in ps}
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (p, g) in enumerate(zip(ps, grads, strict=True)):
            p0, m0, v0 = before[id(p)] or (init[i], torch.zeros_like(p, dtype=torch.bfloat16),
                                          torch.zeros_like(p, dtype=torch.bfloat16))
            m = BETAS[0] * m0.float() + (1 - BETAS[0]) * g
            v = BETAS[1] * v0.float() + (1 - BETAS[1]) * g * g
            st = opt.state[p]
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
            assert torch.equal(st["exp_avg"], m.bfloat16()) and torch.equal(st["exp_avg_sq"], v.bfloat16())
            s = torch.tensor(float(step))
            want = p0 - LR * WD * p0
            want = want - (LR / (1 - torch.pow(BETAS[0], s))) * m / (v.sqrt() / torch.sqrt(1 - torch.pow(BETAS[1], s))
                                                                     + EPS)
            assert torch.equal(p.detach(), want)
            assert float(st["step"]) == step


def test_bf16_moments_track_fp32_adamw() -> None:
    init, N = _params(2), 20
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = AdamW(ours, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    gen = torch.Generator().manual_seed(3)
    largest = [torch.zeros_like(r) for r in ref]  # each element's largest |m| so far (the roundings' scale)
    for _ in range(N):
        for p, r in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for big, r in zip(largest, ref, strict=True):
            torch.maximum(big, ref_opt.state[r]["exp_avg"].abs(), out=big)
    for p, r, big in zip(ours, ref, largest, strict=True):
        diff = (p - r).abs().max().item()
        assert diff <= N * 20 * 2.0**-9 * LR * 4, f"|p - p32| {diff:.3g} after {N} steps"
        assert diff > 0  # the moments are rounded: not fp32 AdamW by accident
        m, m32 = opt.state[p]["exp_avg"].float(), ref_opt.state[r]["exp_avg"]
        assert bool(((m - m32).abs() <= 10 * 2.0**-9 * big).all()), "exp_avg beyond its roundings' bound"


def test_clip_factor_and_skip_flag_on_the_device() -> None:
    init = _params(4)
    a, b = ([torch.nn.Parameter(t.clone()) for t in init] for _ in range(2))
    opt_a = AdamW(a, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=torch.bfloat16)
    opt_b = AdamW(b, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=torch.bfloat16)
    assert opt_a.folds_clip and opt_a.skips_on_device
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(p.shape, generator=gen) for p in a]
    for p, q, g in zip(a, b, grads, strict=True):
        p.grad, q.grad = g.clone(), g / 2.5
    opt_a.clip_next_step(torch.tensor(2.5))
    opt_a.step()
    opt_b.step()
    assert not hasattr(opt_a, "grad_scale"), "the clip factor is for one step only"
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=4 * 2.0**-24)
    saved = {id(p): (p.detach().clone(), opt_a.state[p]["exp_avg"].clone(), opt_a.state[p]["exp_avg_sq"].clone())
             for p in a}
    for p in a:
        p.grad = torch.full_like(p, float("nan"))
    opt_a.skip_next_step_if(torch.tensor(1.0))
    opt_a.step()
    for p in a:
        p0, m0, v0 = saved[id(p)]
        st = opt_a.state[p]
        assert torch.equal(p.detach(), p0) and torch.equal(st["exp_avg"], m0) and torch.equal(st["exp_avg_sq"], v0)
        assert float(st["step"]) == 1, "a skipped step does not count"


def _trainer(run_dir: Path, state_dtype: str, **kw) -> Trainer:
    torch.set_num_threads(1)
    cfg = small_config("local", 1, run_dir=str(run_dir), **kw)
    cfg.optim.state_dtype = state_dtype
    return Trainer(cfg, single_process_layout(CPU))


def test_trainer_learns_and_resumes_with_bf16_moments(tmp_path: Path) -> None:
    """The losses of 6 steps stay within 1e-3 relative of the fp32-moment run's (the moments' roundings move the
    parameters by ~1e-3 lr a step; the loss falls by ~1e-1 over these steps), every moment is bf16 in memory and
    in the checkpoint, and a resume from step 3 finishes bitwise as the run without interruption."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        t = _trainer(tmp_path / dtype, dtype)
        runs[dtype] = (train(t, 6), full_state(t))
        t.close()
    losses32, losses16 = runs["float32"][0], runs["bfloat16"][0]
    assert losses16[-1] < losses16[0] - 0.05, f"bf16 moments: the loss did not fall: {losses16}"
    assert losses16 == pytest.approx(losses32, rel=1e-3)
    moments = {k: v for k, v in runs["bfloat16"][1].items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and all(v.dtype == torch.bfloat16 for v in moments.values())

    first = _trainer(tmp_path / "resume", "bfloat16")
    train(first, 3)
    first.save_checkpoint()
    first.close()
    second = _trainer(tmp_path / "resume", "bfloat16")
    second.load_checkpoint(second.checkpoint_dir / "step_00000003")
    assert train(second, 3) == runs["bfloat16"][0][3:]
    assert_bitwise(full_state(second), runs["bfloat16"][1], "bf16 moments resumed")
    second.close()


@pytest.mark.parametrize(("saved", "resumed"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_checkpoint_resumes_with_the_other_moment_dtype(tmp_path: Path, saved: str, resumed: str) -> None:
    first = _trainer(tmp_path, saved)
    train(first, 2)
    want = {k: v for k, v in full_state(first).items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    first.save_checkpoint()
    first.close()
    second = _trainer(tmp_path, resumed)
    second.load_checkpoint(second.checkpoint_dir / "step_00000002")
    got = {k: v for k, v in full_state(second).items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    target = torch.bfloat16 if resumed == "bfloat16" else torch.float32
    for name, ref in want.items():
        assert got[name].dtype == target and torch.equal(got[name], ref.to(target)), name
    train(second, 1)  # steps on with the converted moments
    second.close()


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"optim\.name=muon set optim\.state_dtype=float32"):
        OptimConfig(name="muon", state_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"leave optim\.fused unset"):
        OptimConfig(state_dtype="bfloat16", fused=True)
    with pytest.raises(ValueError, match=r"optim\.state_dtype must be"):
        OptimConfig(state_dtype="float16")


def _fsdp_run(rank: int, world: int, run_dir: str, dtype: str) -> tuple[list[float], list[str]]:
    from moontrain.parallel.layout import build_layout

    torch.set_num_threads(1)
    cfg = small_config("alltoall", 1, run_dir=run_dir)
    cfg.optim.state_dtype = dtype
    trainer = Trainer(cfg, build_layout(1, CPU))
    losses = train(trainer, 4)
    dtypes = sorted({str(v.dtype) for k, v in full_state(trainer).items() if k.endswith(("exp_avg", "exp_avg_sq"))})
    trainer.close()
    return losses, dtypes


def test_fsdp_shards_step_with_bf16_moments(tmp_path: Path) -> None:
    """Two ranks, the dense parameters FSDP2 shards (DTensors): the bf16-moment step works on each rank's rows,
    as the fp32 one (losses within the bound of test_trainer_learns_and_resumes_with_bf16_moments)."""
    from tests.dist_utils import run_ranks

    (l32, d32), (l16, d16) = (run_ranks(_fsdp_run, 2, str(tmp_path / d), d)[0] for d in ("float32", "bfloat16"))
    assert d32 == ["torch.float32"] and d16 == ["torch.bfloat16"]
    assert l16 == pytest.approx(l32, rel=1e-3) and l16 != l32
