"""WriteBackAdamW against torch's AdamW on copies of the same parameters (shared by the CPU test in
Triton's interpreter and the GPU test).

Registered parameters take the fused Triton step; an unregistered one goes through torch's step in the
same call. The reference sees each grad already divided by the clip factor (what grad_scale means).
Tolerance: both evaluate the same fp32 formula, the kernel with possible FMA contraction: a few ulps
of |p| plus of the update lr * |m| / (sqrt(v) + eps) <= ~lr / (1 - beta1) per step. Over 3 steps
64 ulps of (max|p| + 10 lr) covers it; a wrong bias correction or decay would miss by ~1e-2 * lr.
"""

from __future__ import annotations

import torch

from moontrain.optim.write_back import WriteBackAdamW

LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8


def check_write_back_matches_adamw(device: str, fused: bool | None, exact_rounding: bool,
                                   torch_param: bool = True, clip: bool = True) -> None:
    """torch_param: include the unregistered parameter; clip: clip_next_step in steps 2 and 3 (torch's
    unfused AdamW rejects grad_scale, so the CPU runs the two separately). exact_rounding: the bf16 write-back copy is bitwise p.to(bf16) (GPU); Triton's interpreter
    truncates fp32 -> bf16 where torch rounds to nearest, so there it is within one bf16 ulp."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(3, 40, 24), (5, 16, 7), (33,)][:3 if torch_param else 2]  # the last: torch's path
    init = [torch.randn(s, device=device, generator=gen) * 0.05 for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    outs = [torch.empty(shapes[0], device=device, dtype=torch.bfloat16), torch.empty(shapes[1], device=device)]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": WD}, {"params": ps[2:], "weight_decay": 0.0}]

    opt = WriteBackAdamW(groups(ours), lr=LR, betas=BETAS, eps=EPS, fused=fused)
    ref_opt = torch.optim.AdamW(groups(ref), lr=LR, betas=BETAS, eps=EPS, fused=fused)
    for p, out, zero in zip(ours[:2], outs, (True, False), strict=True):  # the second: a deferring backend's
        opt.register_write_back(p, out, zero_grad=zero)
    for step, scale in enumerate((None, 2.5, 1.0) if clip else (None, None, None)):
        grads = [torch.randn(s, device=device, generator=gen) for s in shapes]
        for p, r, g in zip(ours, ref, grads, strict=True):
            p.grad = g.clone()
            r.grad = g.clone() if scale is None else g / scale
        if scale is not None:
            opt.clip_next_step(torch.tensor(scale, device=device))
        held = [p.grad for p in ours[:2]]
        sent = [g.clone() for g in held]
        opt.step()
        ref_opt.step()
        assert not hasattr(opt, "grad_scale"), "the clip factor is for one step only"
        assert opt.written_back == {id(p) for p in ours[:2]}
        for p, g, before, out, zero in zip(ours[:2], held, sent, outs, (True, False), strict=True):
            assert p.grad is None, "the registered grads are released"
            if zero:
                assert not g.any(), "zero_grad=True: the grad is zeroed"
            else:
                assert torch.equal(g, before), "zero_grad=False: the grad is left as it was"
            want = p.detach().to(out.dtype)
            if exact_rounding or out.dtype == torch.float32:
                assert torch.equal(out, want), "the write-back copy is the new parameter"
            else:
                ulp = want.float().abs() * 2.0**-7
                assert bool(((out.float() - want.float()).abs() <= ulp).all()), "write-back copy beyond 1 ulp"
        for p in ours[2:]:
            assert p.grad is not None  # torch's path leaves its grad alone
            p.grad = None
        for r in ref:
            r.grad = None
        for p, r in zip(ours, ref, strict=True):
            tol = 64 * 2.0**-24 * (float(r.detach().abs().max()) + 10 * LR)
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=tol, msg=f"step {step}: param")
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = opt.state[p][key], ref_opt.state[r][key]
                # torch's foreach path uses lerp (m + (1 - beta1) (g - m)), the kernel the fused form:
                # a few ulps of the operands' magnitude, not of a cancelled result
                torch.testing.assert_close(a, b, rtol=0, atol=16 * 2.0**-24 * float(b.abs().max()),
                                           msg=f"step {step}: {key}")
            assert float(opt.state[p]["step"]) == float(ref_opt.state[r]["step"]) == step + 1


def check_write_back_skips_on_the_flag(device: str, fused: bool | None) -> None:
    """skip_next_step_if: a step with NaN grads and the flag at 1 leaves p, m, v and the step count bitwise
    as they were (the compute copy is rewritten from the unchanged p, the grad zeroed as usual); a later step
    with the flag at 0 equals the step of a run that never saw the skipped one (reference: that run)."""
    gen = torch.Generator(device=device).manual_seed(1)
    shapes = [(3, 40, 24), (5, 16, 7)]
    init = [torch.randn(s, device=device, generator=gen) * 0.05 for s in shapes]
    grads = [[torch.randn(s, device=device, generator=gen) for s in shapes] for _ in range(2)]
    runs = []
    for skipped in (True, False):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        outs = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes]
        opt = WriteBackAdamW([{"params": ps, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS, fused=fused)
        for p, out in zip(ps, outs, strict=True):
            opt.register_write_back(p, out)
        assert opt.skips_on_device
        for step, gs in enumerate([grads[0], None, grads[1]] if skipped else [grads[0], grads[1]]):
            flag = torch.tensor(0.0 if gs is not None else 1.0, device=device)
            bad = gs is None
            for p, g in zip(ps, gs or [torch.full(s, float("nan"), device=device) for s in shapes], strict=True):
                p.grad = g.clone()
            held = [p.grad for p in ps]
            before = [(p.detach().clone(), *(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step")))
                      for p in ps] if bad else None
            opt.skip_next_step_if(flag)
            opt.step()
            assert not hasattr(opt, "found_inf"), "the flag is for one step only"
            assert all(not g.any() for g in held), f"step {step}: the grads are zeroed"
            if bad:
                for p, (p0, m0, v0, s0) in zip(ps, before, strict=True):
                    for name, got, want in (("p", p.detach(), p0), ("exp_avg", opt.state[p]["exp_avg"], m0),
                                            ("exp_avg_sq", opt.state[p]["exp_avg_sq"], v0),
                                            ("step", opt.state[p]["step"], s0)):
                        assert torch.equal(got, want), f"a skipped step changed {name}"
            for p, out in zip(ps, outs, strict=True):
                want = p.detach().to(out.dtype)
                assert bool(((out.float() - want.float()).abs() <= want.float().abs() * 2.0**-7).all())
        runs.append([(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"])
                     for p in ps])
    for got, want in zip(*runs, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), "the step after a skip differs from a run without the skipped step"


def check_write_back_many_tensors(device: str, exact_rounding: bool) -> None:
    """One launch over many tensors (sizes around the kernel's 2048-element block, bf16 and fp32 copies in
    one group) against torch's AdamW, then again after the moments moved to new tensors (what a checkpoint
    load does): the launch tables follow the tensors' addresses. Tolerance as check_write_back_matches_adamw."""
    gen = torch.Generator(device=device).manual_seed(2)
    numels = [1, 2047, 2048, 2049, 4099, 7, 5000, 64]
    init = [torch.randn(n, device=device, generator=gen) * 0.05 for n in numels]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    outs = [torch.empty(n, device=device, dtype=torch.bfloat16 if i % 3 else torch.float32)
            for i, n in enumerate(numels)]
    opt = WriteBackAdamW([{"params": ours, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS)
    ref_opt = torch.optim.AdamW([{"params": ref, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS)
    for p, out in zip(ours, outs, strict=True):
        opt.register_write_back(p, out, zero_grad=False)
    for step in range(3):
        if step == 2:  # new moment tensors, the same values
            for p in ours:
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][key] = opt.state[p][key].clone()
        for p, r in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, device=device, generator=gen)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for p, r, out in zip(ours, ref, outs, strict=True):
            tol = 64 * 2.0**-24 * (float(r.detach().abs().max()) + 10 * LR)
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=tol, msg=f"step {step}: {p.numel()}")
            want = p.detach().to(out.dtype)
            if exact_rounding or out.dtype == torch.float32:
                assert torch.equal(out, want), f"step {step}: the copy of {p.numel()} elements"
            else:  # the interpreter truncates to bf16
                assert bool(((out.float() - want.float()).abs() <= want.float().abs() * 2.0**-7).all())


def check_write_back_bf16_moments(device: str) -> None:
    """optim.state_dtype=bfloat16: the fused pass with bf16 moments against its specification, moontrain's AdamW
    with bf16 moments (moontrain.optim.torch_adamw), on copies of the same parameters over 3 steps with a clip
    factor and a skipped step; one parameter goes through the specification's own step in the same call.
    Bounds: the kernel's fp32 values differ from the specification's by contraction (a few fp32 ulps), which
    can flip a moment's rounding to bf16 by one ulp (2^-8 of it; the interpreter truncates: one ulp too) in a
    step; such a flip moves the update by 2^-8 of itself, lr times m^ / sqrt(v^) (below 4 here). Over 3 steps:
    moments within 3 bf16 ulps of their largest value, parameters within 3 * 2^-8 * 4 lr plus 64 fp32 ulps."""
    from moontrain.optim.torch_adamw import AdamW

    gen = torch.Generator(device=device).manual_seed(6)
    shapes = [(3, 40, 24), (5, 16, 7), (33,)]
    init = [torch.randn(s, device=device, generator=gen) * 0.05 for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    outs = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes[:2]]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": WD}, {"params": ps[2:], "weight_decay": 0.0}]

    opt = WriteBackAdamW(groups(ours), lr=LR, betas=BETAS, eps=EPS, state_dtype=torch.bfloat16)
    ref_opt = AdamW(groups(ref), lr=LR, betas=BETAS, eps=EPS, state_dtype=torch.bfloat16)
    for p, out in zip(ours[:2], outs, strict=True):
        opt.register_write_back(p, out)
    assert opt.folds_clip and opt.skips_on_device
    for step, (scale, skip) in enumerate(((None, 0.0), (2.5, 0.0), (1.0, 1.0), (None, 0.0))):
        for p, r in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, device=device, generator=gen)
            p.grad, r.grad = g.clone(), g.clone()
        for o in (opt, ref_opt):
            if scale is not None:
                o.clip_next_step(torch.tensor(scale, device=device))
            o.skip_next_step_if(torch.tensor(skip, device=device))
            o.step()
        for p in ours[2:]:
            p.grad = None
        for p, r in zip(ours, ref, strict=True):
            st, rst = opt.state[p], ref_opt.state[r]
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
            assert float(st["step"]) == float(rst["step"]) == (1, 2, 2, 3)[step], "the skipped step does not count"
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = st[key].float(), rst[key].float()
                tol = 3 * 2.0**-8 * float(b.abs().max())
                torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=f"step {step}: {key}")
            tol = 3 * 2.0**-8 * 4 * LR + 64 * 2.0**-24 * float(r.detach().abs().max())
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=tol, msg=f"step {step}: param")
        for p, out in zip(ours[:2], outs, strict=True):
            want = p.detach().to(out.dtype)
            assert bool(((out.float() - want.float()).abs() <= want.float().abs() * 2.0**-7).all())


def check_bf16_moment_step_on_the_gpu_matches_the_cpu() -> None:
    """moontrain's AdamW with bf16 moments steps GPU parameters that are not written back (FSDP's shards, here
    plain ones) through the write-back kernel, CPU ones through torch ops (the specification): the same 4 steps
    (a clip factor, a skipped step) on both, within check_write_back_bf16_moments's bounds. The last parameter
    starts 4 bytes past a 16-byte boundary (as an FSDP grad can): it takes the torch ops on the GPU too, in the
    same group."""
    from moontrain.optim.torch_adamw import AdamW

    gen = torch.Generator().manual_seed(7)
    shapes = [(3, 40, 24), (5, 16, 7), (33,), (45,)]
    init = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    sides = {}
    for device in ("cpu", "cuda"):
        ps = [torch.nn.Parameter(t.clone().to(device)) for t in init[:-1]]
        ps.append(torch.nn.Parameter(torch.cat([torch.zeros(1), init[-1]]).to(device)[1:]))  # misaligned
        assert device == "cpu" or ps[-1].data_ptr() % 16 == 4
        sides[device] = (ps, AdamW([{"params": ps, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS,
                                   state_dtype=torch.bfloat16))
    for step, (scale, skip) in enumerate(((None, 0.0), (2.5, 0.0), (1.0, 1.0), (None, 0.0))):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for device, (ps, opt) in sides.items():
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.to(device)
            if scale is not None:
                opt.clip_next_step(torch.tensor(scale, device=device))
            opt.skip_next_step_if(torch.tensor(skip, device=device))
            opt.step()
        (cpu_ps, cpu_opt), (gpu_ps, gpu_opt) = sides["cpu"], sides["cuda"]
        for p, q in zip(cpu_ps, gpu_ps, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = gpu_opt.state[q][key].cpu().float(), cpu_opt.state[p][key].float()
                torch.testing.assert_close(a, b, rtol=0, atol=3 * 2.0**-8 * float(b.abs().max()), msg=f"{step} {key}")
            tol = 3 * 2.0**-8 * 4 * LR + 64 * 2.0**-24 * float(p.detach().abs().max())
            torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=0, atol=tol, msg=f"step {step}: param")
            assert float(gpu_opt.state[q]["step"]) == float(cpu_opt.state[p]["step"]) == (1, 2, 2, 3)[step]
