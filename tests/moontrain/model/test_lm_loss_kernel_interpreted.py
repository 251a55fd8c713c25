"""moontrain.model.lm_loss_kernel in Triton's interpreter on the CPU: the chunk's loss and logits gradient against
the specification (lm_loss.chunk_loss_and_grad / chunk_loss) evaluated in float64 on the same logits.

Bounds. The lse is a V-term fp32 sum of exponentials (split into parts, then combined) and one log: within
16 V u of float64 relative to |lse| + 1 (u = 2^-24, Higham's gamma_k; 16 covers the rescalings and the log).
The loss sums c terms lse - x_target: within 16 (V + c) u of the sum of their magnitudes. Each gradient entry
exp(x - lse) / N carries the lse's error as a relative error, then one rounding to the logits' dtype: for bf16
2^-7 relative (the interpreter truncates; the GPU rounds to nearest, 2^-8); the target's entry p - 1/N has an
absolute error of the same order times 1/N; so each gradient is within (16 V u (max|lse| + 1) + cast) of the
largest gradient magnitude.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and skips this module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model import lm_loss, lm_loss_kernel

U32 = 2.0**-24


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 16 columns and splits of 64: V = 200 over four splits (the last 8 columns), tiles past V."""
    monkeypatch.setattr(lm_loss_kernel, "BLOCK_V", 16)
    monkeypatch.setattr(lm_loss_kernel, "SPLIT_V", 64)


def _chunk(c: int, V: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(c, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (c,), generator=g)
    targets[0], targets[-1] = 0, V - 1  # the first and the last column
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_grad_match_spec(dtype: torch.dtype, small_tiles: None) -> None:
    c, V, N = 7, 200, 50
    logits, targets = _chunk(c, V, dtype, seed=1)
    want_loss, want_grad = lm_loss.chunk_loss_and_grad(logits.double(), targets, 1.0 / N)
    lse = torch.logsumexp(logits.double(), dim=1)
    work = logits.clone()
    loss, grad = lm_loss_kernel.chunk_loss_and_grad(work, targets, 1.0 / N)
    assert grad.data_ptr() == work.data_ptr() and grad.dtype == dtype  # written over the logits
    assert loss.dtype == torch.float32
    magnitude = (lse - logits.double().gather(1, targets[:, None]).squeeze(1)).abs().sum().item()
    assert abs(loss.item() - want_loss.item()) <= 16 * (V + c) * U32 * magnitude
    cast = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    rel = 16 * V * U32 * (lse.abs().max().item() + 1) + cast
    diff = (grad.double() - want_grad).abs().max().item()
    assert diff <= rel * want_grad.abs().max().item(), (diff, want_grad.abs().max().item())
    assert grad.double().sum(1).abs().max().item() <= 1e-2 / N  # a row of softmax minus one-hot sums to 0
    loss_only = lm_loss_kernel.chunk_loss(logits, targets)
    assert abs(loss_only.item() - want_loss.item()) <= 16 * (V + c) * U32 * magnitude


def test_one_split_and_rows_of_extreme_logits(small_tiles: None) -> None:
    """V inside one split (no combination across parts) and logits far from 0 (the max's subtraction matters)."""
    logits, targets = _chunk(3, 40, torch.float32, seed=2)
    logits[1] += 80.0
    logits[2] -= 80.0
    want_loss, want_grad = lm_loss.chunk_loss_and_grad(logits.double(), targets, 0.25)
    loss, grad = lm_loss_kernel.chunk_loss_and_grad(logits.clone(), targets, 0.25)
    assert abs(loss.item() - want_loss.item()) <= 16 * 43 * U32 * 3 * 90
    assert (grad.double() - want_grad).abs().max().item() <= 16 * 40 * U32 * 91 * 0.25


def test_linear_cross_entropy_with_the_kernels_matches_the_spec(small_tiles: None) -> None:
    """The fused head through autograd with kernels.lm_loss=triton's chunk math against the PyTorch chunk math:
    the loss and the gradients of h and the weight (chunks of 5 tokens over 12, the last partial), fp32."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(12, 24, generator=g, requires_grad=True)
    w = (torch.randn(200, 24, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, 200, (12,), generator=g)
    outs = []
    for math in (lm_loss.EAGER, lm_loss.triton_math()):
        loss = lm_loss.linear_cross_entropy(h, w, t, chunk=5, math=math)
        outs.append((loss, *torch.autograd.grad(loss, (h, w))))
    for name, a, b in zip(("loss", "grad h", "grad w"), outs[1], outs[0], strict=True):
        diff = (a - b).abs().max().item()
        assert diff <= 16 * 200 * U32 * 20 * b.abs().max().item(), f"{name}: {diff:.3g}"
    with torch.no_grad():
        eval_loss = lm_loss.linear_cross_entropy(h, w, t, chunk=5, math=lm_loss.triton_math())
    assert abs(eval_loss.item() - outs[0][0].item()) <= 16 * 212 * U32 * 20 * outs[0][0].item()


def _bf16_cases(seed: int) -> torch.Tensor:
    """bf16 values of every normal scale whose products with the tests' scales stay normal, the largest finite
    values (scaled past the range they round to inf), zeros of both signs, infinities and NaNs; [1253, 4].
    Not subnormals: the interpreter's arithmetic on them is not the GPU's (the GPU test includes them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5000, generator=g) * torch.exp2(torch.randint(-120, 126, (5000,), generator=g).float())
    x = torch.where(x.abs() < 2.0**-120, 1.0, x)  # the scales shrink by at most 8: products above 2^-126
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3e38, -3.3e38, 1e-30, -1e-30])
    bits = torch.tensor([0x7FFF, 0xFFC1 - 0x10000, 0x7F81], dtype=torch.int16)  # NaNs with other payloads
    return torch.cat([x.to(torch.bfloat16), specials.to(torch.bfloat16), bits.view(torch.bfloat16)]).view(-1, 4)


@pytest.mark.parametrize("scale", [1 / 3, 0.125, 3.0, -0.7], ids=["third", "eighth", "three", "negative"])
def test_scale_pass_is_bitwise_the_specification(scale: float) -> None:
    """scaled_bf16 (backward's grad * grad of the loss, one pass) against lm_loss._scaled's PyTorch passes: the
    same bits everywhere, NaN where it gives NaN; a grad of several programs with a partial last one."""
    grad = _bf16_cases(seed=int(abs(scale) * 1000))
    s = torch.tensor(scale)
    got = lm_loss_kernel.scaled_bf16(grad, s)
    want = lm_loss._scaled(grad, s)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    mismatch = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not mismatch.any(), (f"{int(mismatch.sum())} mismatches, the first at {mismatch.nonzero()[0].tolist()}: "
                                f"{grad[mismatch][0].item()} * {scale} -> {got[mismatch][0].item()}, "
                                f"want {want[mismatch][0].item()}")
    with pytest.raises(ValueError, match=r"scaled_bf16 takes a contiguous bf16 gradient .* got torch.float32"):
        lm_loss_kernel.scaled_bf16(grad.float(), s)


def test_fused_head_scales_its_bf16_grads_with_the_kernel() -> None:
    """The fused head in bf16 with the Triton chunk math, backward with a grad of 1 / 3 (not a power of two):
    the gradients of h and the weight bitwise those of the same chunk math scaled by _scaled's PyTorch passes."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(12, 24, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(200, 24, generator=g) * 0.3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 200, (12,), generator=g)
    kernels = lm_loss.triton_math()
    grads = []
    for math in (kernels, kernels._replace(scaled_bf16=None)):
        loss = lm_loss.linear_cross_entropy(h, w, t, chunk=5, math=math)
        grads.append(torch.autograd.grad(loss / 3, (h, w)))
    for name, a, b in zip(("grad h", "grad w"), *grads, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_model_choice_and_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.lm_loss: triton under the interpreter picks the kernels, auto on the CPU the PyTorch math, triton
    on the CPU without the interpreter an error naming the fix; the kernels refuse strided logits."""
    assert lm_loss.chunk_math("triton", "cpu") is lm_loss.triton_math()
    assert lm_loss.chunk_math("auto", "cpu") is lm_loss.EAGER
    assert lm_loss.chunk_math("torch", "cuda") is lm_loss.EAGER
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"kernels.lm_loss=triton runs on a CUDA device .* this model is on cpu; "
                                         r"kernels.lm_loss=auto picks the PyTorch chunk math there"):
        lm_loss.chunk_math("triton", "cpu")
    logits, targets = _chunk(4, 40, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"the CE kernels take contiguous logits \[c, V\] and targets \[c\], got "
                                         r"logits \(4, 20\) \(contiguous: False\)"):
        lm_loss_kernel.chunk_loss(logits[:, ::2], targets)
