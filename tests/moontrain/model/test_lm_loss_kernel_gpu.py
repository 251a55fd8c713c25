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
