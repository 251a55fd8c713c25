"""Muon and QK-Clip on a GPU: Newton-Schulz against its exact polynomial, the max-logit pass on bf16 q/k
(packed documents) against an fp64 recomputation, and one Muon step on CUDA against the same step on
the CPU (bf16 Newton-Schulz on both: the difference is bounded by the NS tolerance times lr * scale)."""

from __future__ import annotations

import math

import pytest
import torch

from moontrain.model.config import ModelConfig
from moontrain.model.max_logit import causal_max_logit
from moontrain.model.transformer import K3Model
from moontrain.optim.adamw import build_optimizer
from moontrain.optim.config import OptimConfig
from moontrain.optim.muon import rms_scale
from tests.moontrain.optim.test_muon import NS_TOL, check_newton_schulz

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1024, 896), (96, 32)])
def test_newton_schulz_matches_its_polynomial_gpu(shape: tuple[int, int]) -> None:
    check_newton_schulz(shape, "cuda")


def test_causal_max_logit_bf16_gpu() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 64, generator=gen).bfloat16()
    k = torch.randn(2, 4, 300, 64, generator=gen).bfloat16()
    doc_BT = torch.cat([torch.zeros(2, 120, dtype=torch.long), torch.ones(2, 180, dtype=torch.long)], dim=1)
    got = causal_max_logit(q.cuda(), k.cuda(), 0.125, doc_BT.cuda()).cpu()
    s = q.double() @ k.double().transpose(-1, -2)
    hidden = torch.triu(torch.ones(300, 300, dtype=torch.bool), 1) | (doc_BT[:, :, None] != doc_BT[:, None, :])[:, None]
    want = s.masked_fill(hidden, -math.inf).amax(dim=(0, 2, 3)) * 0.125
    # one bf16 rounding of the fp32-accumulated score (relative 2^-8), plus fp32 accumulation over 64 terms
    torch.testing.assert_close(got.double(), want, rtol=2.0**-8, atol=1e-4)


def _model(device: str) -> K3Model:
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=2, dense_intermediate_size=128, num_heads=2,
                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=64)
    model = K3Model(cfg, device="cpu")
    model.init_weights(0)  # on the CPU: a CUDA generator draws other values from the same seed
    return model.to(device)


def test_muon_step_cuda_matches_cpu() -> None:
    lr = 0.01
    cfg = OptimConfig(name="muon", lr=lr, weight_decay=0.1, schedule="constant", muon_per_head_qkv=True,
                      write_back=False)
    cpu, gpu = _model("cpu"), _model("cuda")
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in cpu.named_parameters()}
    opts = []
    for model in (cpu, gpu):
        for n, p in model.named_parameters():
            p.grad = grads[n].to(p.device)
        opt, _ = build_optimizer(model, cfg, total_steps=1)
        opt.step()
        opts.append(opt)
    muon_names = {n for g in opts[0].param_groups if g["kind"] != "adamw" for n, p in cpu.named_parameters()
                  if any(p is q for q in g["params"])}
    for (n, p_cpu), (_, p_gpu) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        diff = (p_gpu.detach().cpu() - p_cpu.detach()).abs().max().item()
        if n in muon_names:  # both NS results are within NS_TOL of the exact polynomial
            tol = 2 * NS_TOL * lr * rms_scale(max(p_cpu.shape[-2:]), max(p_cpu.shape[-2:]))
        else:  # AdamW: fused (GPU) vs foreach (CPU) fp32 arithmetic
            tol = 1e-6
        assert diff <= tol, f"{n}: max |cuda - cpu| {diff:.3g} > {tol:.3g}"
