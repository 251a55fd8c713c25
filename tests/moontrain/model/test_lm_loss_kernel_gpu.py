"""moontrain.model.lm_loss_kernel on one GPU at k3_small's chunk (1,536 tokens x 163,840 logits, bf16): the loss
and the logits gradient against the specification (lm_loss.chunk_loss_and_grad) in float64 on the same logits,
and against the compiled specification training runs otherwise. Bounds as
tests/moontrain/model/test_lm_loss_kernel_interpreted.py derives them, with the GPU's round-to-nearest bf16 cast
(2^-8 relative)."""

from __future__ import annotations

import pytest
import torch

from moontrain.model import lm_loss

pytestmark = pytest.mark.gpu

C, V, N = 1536, 163840, 16384
U32 = 2.0**-24


def test_chunk_math_matches_spec_at_k3_small_chunk() -> None:
    # imported here: collected on the CPU before a *_interpreted module sets TRITON_INTERPRET, a module-level
    # import would decorate the kernels for the GPU driver
    from moontrain.model import lm_loss_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(C, V, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, V, (C,), device="cuda", generator=gen)
    want_loss, want_grad = lm_loss.chunk_loss_and_grad(logits.double(), targets, 1.0 / N)
    lse = torch.logsumexp(logits.double(), dim=1)
    loss, grad = lm_loss_kernel.chunk_loss_and_grad(logits.clone(), targets, 1.0 / N)
    magnitude = (lse - logits.double().gather(1, targets[:, None]).squeeze(1)).abs().sum().item()
    assert abs(loss.item() - want_loss.item()) <= 16 * (V + C) * U32 * magnitude
    rel = 16 * V * U32 * (lse.abs().max().item() + 1) + 2.0**-8
    diff = (grad.double() - want_grad).abs().max().item()
    assert diff <= rel * want_grad.abs().max().item(), (diff, want_grad.abs().max().item())
    loss_only = lm_loss_kernel.chunk_loss(logits, targets)
    assert abs(loss_only.item() - want_loss.item()) <= 16 * (V + C) * U32 * magnitude
    del want_grad
    ref_loss, ref_grad = lm_loss.compiled_math().loss_and_grad(logits.clone(), targets, 1.0 / N)
    assert abs(loss.item() - ref_loss.item()) <= 2 * 16 * (V + C) * U32 * magnitude
    assert (grad.float() - ref_grad.float()).abs().max().item() <= 2 * rel * ref_grad.float().abs().max().item()


def test_scale_pass_is_bitwise_the_specification_at_the_head_weight() -> None:
    """Backward's scale of the saved weight gradient ([V, D] bf16 at k3_small's head, a scale of 1/3) in one Triton
    pass against lm_loss._scaled's PyTorch passes: the same bits, subnormals, infinities, NaNs and the largest
    finite values (scaled past the range) included."""
    from moontrain.model import lm_loss_kernel

    gen = torch.Generator(device="cuda").manual_seed(2)
    grad = torch.randn(V, 2048, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-133, 127, (V, 2048), device="cuda", generator=gen).float())
    grad = grad.to(torch.bfloat16)
    grad[0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3e38, -3.3e38, 1e-40])
    for scale in (1 / 3, 3.0):
        s = torch.tensor(scale, device="cuda")
        got, want = lm_loss_kernel.scaled_bf16(grad, s), lm_loss._scaled(grad, s)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        mismatch = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
        assert not mismatch.any(), f"scale {scale}: {int(mismatch.sum())} elements differ, the first at " \
                                   f"{mismatch.nonzero()[0].tolist()}"
