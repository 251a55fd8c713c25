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

import math

import pytest
import torch
import torch.nn.functional as F

from moontrain.model.lm_loss import (
    EAGER,
    LOGITS_BYTES_PER_CHUNK,
    chunk_tokens,
    compiled_math,
    linear_cross_entropy,
)

U32 = 2.0 ** -24
N, D, V = 50, 32, 97


def _inputs(dtype: torch.dtype, n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dtype).requires_grad_()  # logits of a few units
    t = torch.randint(0, V, (n,), generator=gen)
    return h, w, t


def _reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_h, grad_W, G): autograd over the materialised logits, and G in fp32 (for the bounds)."""
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.float(), t)
    gh, gw = torch.autograd.grad(loss * scale, (h, w))
    p = torch.softmax(logits.detach().float(), -1)
    G = (p - F.one_hot(t, w.shape[0]).float()) * (scale / h.shape[0])
    return loss.detach(), gh, gw, G


def _check(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    diff = (got.float() - ref.float()).abs()
    excess = diff - bound
    i = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: element {i}: |diff| {diff.flatten()[i]:.3g} > bound {bound.flatten()[i]:.3g} "
                               f"(ref {ref.flatten()[i].item():.6g}, got {got.flatten()[i].item():.6g})")


def _compare(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int | None, scale: float = 1.0,
             chunk_math=EAGER) -> None:
    loss_ref, gh_ref, gw_ref, G = _reference(h, w, t, scale)
    loss = linear_cross_entropy(h, w, t, chunk=chunk, math=chunk_math)
    gh, gw = torch.autograd.grad(loss * scale, (h, w))
    assert loss.dtype == torch.float32 and gh.dtype == h.dtype and gw.dtype == w.dtype
    with torch.no_grad():
        hf, wf = h.float(), w.float()
        logits = F.linear(h, w).float()
        c = chunk or chunk_tokens(w.shape[0])
        delta = max((F.linear(h[i:i + c], w).float() - logits[i:i + c]).abs().max().item()
                    for i in range(0, h.shape[0], c))
        k = 4 * (h.shape[0] + w.shape[0] + logits.abs().max().item() + 4)
        P = torch.softmax(logits, -1) * (abs(scale) / h.shape[0])
        G_bound = k * U32 * G.abs() + 2 * delta * P
        if h.dtype == torch.float32:
            bound_h, bound_w = G_bound @ wf.abs(), G_bound.T @ hf.abs()
        else:
            G_bound = G_bound + 2.0 ** -7 * G.abs()
            rounding = 2.0 ** -7 + (0.0 if math.frexp(scale)[0] == 0.5 else 2.0 ** -8)  # the scale's rounding
            bound_h = G_bound @ wf.abs() + rounding * gh_ref.float().abs()
            bound_w = G_bound.T @ hf.abs() + rounding * gw_ref.float().abs()
    _check(loss, loss_ref, k * U32 * (loss_ref + 1) + 2 * delta, f"loss (chunk {chunk})")
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_matches_cross_entropy_on_cuda_bf16(compiled: bool) -> None:
    """The CUDA path: cuBLAS's bf16 GEMM accumulating grad_W into fp32 (addmm out_dtype), inductor's fused
    chunk math; a vocab and N of k3_small's kind in miniature (V = 4,099: chunks of 256 rows at a 4 MiB budget
    would be the same code path as 1 GiB at V = 163,840)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1000, 256, 4099
    h = torch.randn(n, d, generator=gen, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=gen, device="cuda") * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen, device="cuda")
    _compare(h, w, t, 256, chunk_math=compiled_math() if compiled else EAGER)
