"""linear_cross_entropy (moontrain.model.lm_loss) against F.cross_entropy over the materialised logits.

Reference: logits = F.linear(h, W) (nn.Linear's call, in h's dtype), F.cross_entropy(logits.float(), t) and
autograd through both. Tolerances, derived per element from the reference's magnitudes (G = the fp32 grad
of the mean CE with respect to the logits, |.| elementwise):
- fp32: the same formulas, sums in another order (loss and grad_W over chunks, sum-exp and GEMMs inside):
  each sum of n terms moves by at most 2 n u times the sum of the terms' magnitudes (u = 2^-24), and an
  error e in a log-sum-exp moves the softmax by e relative. With k = 4 (N + V + max|logit| + 4) that is
  k u (loss + 1) for the loss, k u |G| |W| for grad_h and k u |G|^T |h| for grad_W.
- bf16: both sides round G once to bf16 (<= 2^-8 relative each, so the two may differ by 2^-7 |G|) and
  round the grads once to bf16 (2^-7 |grad| between them); plus the fp32 terms above, and the effect of the
  head's GEMM giving a chunk's rows other values than the whole product's (measured: delta = max |logit
  difference|, which moves each softmax entry by at most 2 delta relative and each token's loss by 2 delta).
The grad of the loss is 1 or 1/3 (backward scales the saved grads by it: exactly when a power of two, with
one more bf16 rounding, 2^-8 |grad|, when not).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import moontrain.model.transformer as transformer
import moontrain.trainer.trainer as trainer_module
from moontrain.model.experts import ExpertsContext
from moontrain.model.lm_loss import (
    EAGER,
    LOGITS_BYTES_PER_CHUNK,
    TRITON_LOGITS_BYTES_PER_CHUNK,
    ChunkMath,
    chunk_loss,
    chunk_loss_and_grad,
    chunk_tokens,
    compiled_math,
    linear_cross_entropy,
    triton_math,
)
from moontrain.model.transformer import K3Model
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import small_config

U32 = 2.0 ** -24
RTOL = 1e-5  # whole-model fp32 grads: the same math in another order (tests/moontrain/model/test_model.py)
CPU = torch.device("cpu")
N, D, V = 50, 32, 97


def _inputs(dtype: torch.dtype, n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dtype).requires_grad_()  # logits of a few units
    t = torch.randint(0, V, (n,), generator=gen)
    return h, w, t


def _check(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    diff = (got.float() - ref.float()).abs()
    excess = diff - bound
    i = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: element {i}: |diff| {diff.flatten()[i]:.3g} > bound {bound.flatten()[i]:.3g} "
                               f"(ref {ref.flatten()[i].item():.6g}, got {got.flatten()[i].item():.6g})")


def bounded_reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int | None, scale: float = 1.0
                      ) -> tuple[torch.Tensor, ...]:
    """(loss, grad_h, grad_W) of the unfused head and CE by autograd, each grad of scale * loss, and the
    bounds of the module docstring on linear_cross_entropy's difference from each."""
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.float(), t)
    gh, gw = torch.autograd.grad(loss * scale, (h, w))
    with torch.no_grad():
        n = h.shape[0]
        hf, wf, logits = h.float(), w.float(), logits.float()
        G = (torch.softmax(logits, -1) - F.one_hot(t, w.shape[0]).float()) * (scale / n)
        c = chunk or chunk_tokens(w.shape[0])
        delta = max((F.linear(h[i:i + c], w).float() - logits[i:i + c]).abs().max().item() for i in range(0, n, c))
        k = 4 * (n + w.shape[0] + logits.abs().max().item() + 4)
        G_bound = k * U32 * G.abs() + 2 * delta * torch.softmax(logits, -1) * (abs(scale) / n)
        rounding = 0.0
        if h.dtype != torch.float32:
            G_bound += 2.0 ** -7 * G.abs()
            rounding = 2.0 ** -7 + (0.0 if math.frexp(scale)[0] == 0.5 else 2.0 ** -8)  # the scale's rounding
        bound_h = G_bound @ wf.abs() + rounding * gh.float().abs()
        bound_w = G_bound.T @ hf.abs() + rounding * gw.float().abs()
    return loss.detach(), gh, gw, k * U32 * (loss.detach() + 1) + 2 * delta, bound_h, bound_w


def _compare(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int | None, scale: float = 1.0,
             chunk_math=EAGER) -> None:
    loss_ref, gh_ref, gw_ref, bound_loss, bound_h, bound_w = bounded_reference(h, w, t, chunk, scale)
    loss = linear_cross_entropy(h, w, t, chunk=chunk, math=chunk_math)
    gh, gw = torch.autograd.grad(loss * scale, (h, w))
    assert loss.dtype == torch.float32 and gh.dtype == h.dtype and gw.dtype == w.dtype
    _check(loss, loss_ref, bound_loss, f"loss (chunk {chunk})")
    _check(gh, gh_ref, bound_h, f"grad_h (chunk {chunk})")
    _check(gw, gw_ref, bound_w, f"grad_W (chunk {chunk})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 10, 16, 50, 64, None], ids=lambda c: f"chunk{c}")
def test_matches_cross_entropy_over_the_logits(dtype: torch.dtype, chunk: int | None) -> None:
    """Chunks that divide N = 50 (1, 10, 50: one chunk), that do not (16: a remainder of 2), larger than N
    (64, and the default from the 1 GiB budget)."""
    _compare(*_inputs(dtype), chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [0.5, 1 / 3], ids=["half", "third"])
def test_grad_of_the_loss_scales_the_saved_grads(dtype: torch.dtype, scale: float) -> None:
    """backward(grad_loss) for 1 / accumulation steps: a power of two and one that is not."""
    _compare(*_inputs(dtype, seed=1), 16, scale)


def test_loss_without_grad_is_the_training_loss_and_frozen_inputs_get_none() -> None:
    """Under no_grad (evaluation) the loss-only path gives bitwise the training forward's loss; a weight
    that needs no grad gets none, and h's grad is unchanged by it."""
    h, w, t = _inputs(torch.float32)
    loss = linear_cross_entropy(h, w, t, chunk=16)
    with torch.no_grad():
        assert torch.equal(linear_cross_entropy(h, w, t, chunk=16), loss.detach())
    (gh,) = torch.autograd.grad(loss, (h,))
    frozen = linear_cross_entropy(h, w.detach(), t, chunk=16)
    assert torch.equal(frozen, loss.detach())
    (gh_frozen,) = torch.autograd.grad(frozen, (h,))
    assert torch.equal(gh_frozen, gh)


def test_chunk_size_from_the_logits_bytes() -> None:
    """The most tokens whose fp32 logits fit in 1 GiB, in whole 128-row tiles: k3_small's vocab 163,840 ->
    1,536 (1,638 fit), DeepSeek-V3's benchmark vocab 32,768 -> 8,192; a vocab too large for a tile -> 1."""
    assert LOGITS_BYTES_PER_CHUNK == 1 << 30
    assert chunk_tokens(163_840) == 1_536 and 1_536 * 163_840 * 4 <= 1 << 30 < 1_664 * 163_840 * 4
    assert chunk_tokens(32_768) == 8_192
    assert chunk_tokens(97) == (1 << 30) // (4 * 97) // 128 * 128
    assert chunk_tokens(1 << 29, logits_bytes=1 << 30) == 1 and chunk_tokens(1 << 22) == 64
    # the Triton chunk math holds only the compute-dtype logits (the gradient written over them): 4 GiB of fp32
    # logits, k3_small's vocab -> 6,528 tokens (3 chunks of a 16k pass instead of 11; docs/performance.md)
    assert EAGER.logits_bytes == LOGITS_BYTES_PER_CHUNK and TRITON_LOGITS_BYTES_PER_CHUNK == 4 << 30
    assert chunk_tokens(163_840, TRITON_LOGITS_BYTES_PER_CHUNK) == 6_528
    pytest.importorskip("triton")
    assert triton_math().logits_bytes == TRITON_LOGITS_BYTES_PER_CHUNK


def test_the_default_chunk_follows_the_math_budget() -> None:
    """Without a chunk, linear_cross_entropy cuts chunks of chunk_tokens(V, math.logits_bytes): a math whose
    budget fits 128 tokens runs N / 128 chunks, with the same values as that chunk given explicitly."""
    h, w, t = (x.detach() for x in _inputs(torch.float32, n=300))
    N, V = h.shape[0], w.shape[0]
    calls = []

    def counted(logits, targets, inv_n):
        calls.append(logits.shape[0])
        return chunk_loss_and_grad(logits, targets, inv_n)

    math = ChunkMath(counted, chunk_loss, logits_bytes=4 * V * 128)
    hi, wi = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hi, wi, t, math=math)
    loss.backward()
    assert calls == [128] * (N // 128) + ([N % 128] if N % 128 else []), calls
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_cross_entropy(hr, wr, t, chunk=128)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(hi.grad, hr.grad) and torch.equal(wi.grad, wr.grad)


def test_bad_shapes_and_chunk_are_refused() -> None:
    h, w, t = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"h \[N, D\] and targets \[N\].*flatten"):
        linear_cross_entropy(h.view(5, 10, D), w, t.view(5, 10))
    with pytest.raises(ValueError, match=r"h \[N, D\] and targets \[N\]"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match=r"chunk=0: tokens per chunk must be >= 1"):
        linear_cross_entropy(h, w, t, chunk=0)


def test_compiled_math_matches_the_reference_bf16() -> None:
    """train.compile's path (the chunk math through torch.compile, CPU inductor here), a remainder chunk
    included, training and evaluation forms: within the same bounds, and its loss-only form equals its
    training loss."""
    h, w, t = _inputs(torch.bfloat16, seed=2)
    compiled = compiled_math()
    _compare(h, w, t, 16, chunk_math=compiled)
    with torch.no_grad():
        ev = linear_cross_entropy(h, w, t, chunk=16, math=compiled)
    assert torch.equal(ev, linear_cross_entropy(h, w, t, chunk=16, math=compiled).detach())


def test_compiled_grad_is_one_pass_to_the_compute_dtype() -> None:
    """The compiled chunk math writes the logits' grad straight in the compute dtype: the code inductor
    generates allocates no fp32 [c, V] buffer (an indexed write of the target's -1/N made it materialise the
    fp32 grad, one more write and read of it per chunk). Values: the eager function's within fp32 order."""
    from torch._inductor.utils import run_and_get_code

    c, V = 64, 1000
    logits = torch.randn(c, V, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    targets = torch.randint(0, V, (c,), generator=torch.Generator().manual_seed(6))
    (loss, grad), codes = run_and_get_code(torch.compile(chunk_loss_and_grad, dynamic=False), logits, targets, 1 / 999)
    allocations = re.findall(r"empty_strided\w*\(\((\d+), (\d+)\), \([^)]*\), (torch\.\w+)\)", "\n".join(codes))
    assert ((str(c), str(V), "torch.bfloat16") in allocations
            and not any(a[:2] == (str(c), str(V)) and a[2] != "torch.bfloat16" for a in allocations)), allocations
    want_loss, want_grad = chunk_loss_and_grad(logits, targets, 1 / 999)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    assert (grad.float() - want_grad.float()).abs().max().item() <= 2.0 ** -8 * want_grad.float().abs().max().item()


def _unfused(h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *, math) -> torch.Tensor:
    """The head and the loss as the training forward computed them before: nn.Linear's logits, fp32 CE."""
    return F.cross_entropy(F.linear(h_ND, weight_VD).float(), targets_N)


def test_training_forward_matches_the_unfused_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """K3Model's loss and every grad (the K3 block: KDA and MLA, AttnRes with non-zero queries, SiTU-GLU,
    latent MoE; 2 x 16 tokens in chunks of 12, a remainder of 8) against the same model with the head and
    the CE unfused, fp32. The two differ in the head's summation order only, which reaches every grad
    through the head's input grad; a grad that is a cancelling sum (the AttnRes queries': 4e-4 from terms
    of order 1) keeps its terms' absolute error, so the bound is absolute: RTOL of the model's largest grad
    element (measured: 1.2e-6 of it at most). The loss within RTOL of itself."""
    run = small_config("local", 1, k3_block=True)
    cfg = run.model
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    out = []
    for head in (lambda h, w, t, *, math: linear_cross_entropy(h, w, t, chunk=12, math=math), _unfused):
        monkeypatch.setattr(transformer, "linear_cross_entropy", head)
        model = K3Model(cfg, kernels=run.kernels)
        model.init_weights(seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".query"):
                    p.normal_(generator=torch.Generator().manual_seed(len(name)))
        model.attach_experts_backends("local", ExpertsContext(
            num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep=1,
            compute_dtype=torch.float32, token_padding=8, max_tokens=32, device=CPU, activation=cfg.ffn_activation))
        loss, ce = model(tokens, tokens.roll(-1, 1))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        grads |= {f"{i}.{k}": g for i, m in enumerate(model.moe_layers()) for k, g in m.experts.grad.items()}
        out.append((loss.detach(), ce, grads))
    (loss, ce, grads), (loss_ref, ce_ref, grads_ref) = out
    assert abs(loss - loss_ref) <= RTOL * loss_ref and abs(ce - ce_ref) <= RTOL * ce_ref, (loss, loss_ref)
    assert grads.keys() == grads_ref.keys() and "lm_head.weight" in grads
    tol = RTOL * max(ref.abs().max().item() for ref in grads_ref.values())
    for name, ref in grads_ref.items():
        diff = (grads[name] - ref).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def _head_under_dense_wrapper(run_dir: str, dense: str) -> tuple:
    """One bf16 step of 3 accumulated passes (the loss's grad 1/3) with parallel.dense=dense at world 1:
    the lm_head master before it, each pass's (h, weight, targets) as linear_cross_entropy received them and
    whether the weight was a DTensor, the master's grad as the optimizer sees it, and the logged loss."""
    cfg = small_config("moonep", 1, run_dir=run_dir, k3_block=True)
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, dense=dense, compute_dtype="bfloat16"),
        train=dataclasses.replace(cfg.train, global_batch_size=6, micro_batch_size=2, log_every=1))
    calls, seen = [], {}

    def spy(h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *, math) -> torch.Tensor:
        calls.append((h_ND.detach().clone(), weight_VD.detach().clone(), targets_N.clone(),
                      isinstance(weight_VD, DTensor)))
        return linear_cross_entropy(h_ND, weight_VD, targets_N, math=math)

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    clip = trainer_module.clip_grad_norm_global

    def record_then_clip(*args, **kwargs):
        seen["grad"] = full(trainer.model.lm_head.weight.grad)
        return clip(*args, **kwargs)

    transformer.linear_cross_entropy, trainer_module.clip_grad_norm_global = spy, record_then_clip
    trainer = Trainer(cfg, build_layout(1, CPU))
    try:
        assert trainer.accumulation_steps == 3 and (trainer.plain_dense is None) == (dense == "fsdp")
        master = full(trainer.model.lm_head.weight)
        loss = trainer.train_step().loss
    finally:
        trainer.close()
        transformer.linear_cross_entropy, trainer_module.clip_grad_norm_global = linear_cross_entropy, clip
    return master, calls, seen["grad"], loss


def _fsdp_and_plain(rank: int, world: int, run_dir: str) -> dict[str, tuple]:
    torch.set_num_threads(1)
    return {dense: _head_under_dense_wrapper(f"{run_dir}/{dense}", dense) for dense in ("fsdp", "plain")}


def test_head_grads_reach_the_master_under_fsdp_and_plain(tmp_path: Path) -> None:
    """parallel.dense=fsdp (FSDP2's root holds lm_head; its pre-forward hook has gathered the weight) and
    plain (the bf16 copy registered in the master's place), bf16 compute, 3 passes: every pass reads the
    gathered bf16 weight (no DTensor), bitwise the master rounded to bf16; the fp32 grad the optimizer sees
    is the sum over passes of autograd's grad over each pass's materialised logits, within the sum of the
    per-pass bounds (module docstring; the fp32 sum of 3 bf16 grads adds at most 2 u of its terms)."""
    for dense, run in run_ranks(_fsdp_and_plain, 1, str(tmp_path))[0].items():
        _check_head_step(dense, *run)


def _check_head_step(dense: str, master: torch.Tensor, calls: list, grad: torch.Tensor, loss: float) -> None:
    assert len(calls) == 3
    want, bound, losses, loss_bounds = 0, 0, [], []
    for h, w, t, is_dtensor in calls:
        assert not is_dtensor and w.dtype == torch.bfloat16 and torch.equal(w, master.bfloat16())
        loss_ref, _, gw_ref, bound_loss, _, bound_w = bounded_reference(
            h.requires_grad_(), w.requires_grad_(), t, None, 1 / 3)
        want, bound = want + gw_ref.float(), bound + bound_w + 2 * U32 * gw_ref.float().abs()
        losses.append(loss_ref.item())
        loss_bounds.append(bound_loss.item())
    _check(grad, want, bound, f"lm_head grad ({dense})")
    assert abs(loss - sum(losses) / 3) <= sum(loss_bounds) / 3 + 4 * U32 * loss, (loss, losses)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_matches_cross_entropy_on_cuda_bf16(compiled: bool) -> None:
    """The CUDA path: cuBLAS's bf16 GEMM accumulating grad_W into fp32 (addmm with out_dtype), and the chunk
    math eager and through inductor; 1,000 tokens in chunks of 256 (a remainder of 232), V = 4,099."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1000, 256, 4099
    h = torch.randn(n, d, generator=gen, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=gen, device="cuda") * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen, device="cuda")
    _compare(h, w, t, 256, chunk_math=compiled_math() if compiled else EAGER)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])])
def test_first_chunk_writes_the_weight_grad_without_reading_it(device: str) -> None:
    """The fp32 accumulator starts uninitialised: the first chunk's GEMM writes it (no input) and the later ones add.
    With the accumulator full of NaN first, the sum of three chunks' products (bf16 products, exact in fp32; on
    CUDA cuBLAS's mixed-dtype addmm) is the float64 sum within its 72 fp32 additions: 72 u of the sum of
    magnitudes."""
    from moontrain.model.lm_loss import _add_outer_

    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(64, 24, generator=gen, device=device).bfloat16() for _ in range(3)]
    hs = [torch.randn(24, 32, generator=gen, device=device).bfloat16() for _ in range(3)]
    got = torch.full((64, 32), float("nan"), device=device)
    for i, (g, h) in enumerate(zip(grads, hs, strict=True)):
        _add_outer_(got, g, h, first=i == 0)
    want = sum(g.double() @ h.double() for g, h in zip(grads, hs, strict=True))
    magnitude = sum(g.double().abs() @ h.double().abs() for g, h in zip(grads, hs, strict=True))
    assert not got.isnan().any()
    assert ((got.double() - want).abs() <= 72 * U32 * magnitude).all()
