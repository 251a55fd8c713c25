"""train.deterministic on one GPU: flex_attention's causal backward (the deterministic path of attention
without documents) bitwise equal over two runs and against SDPA within bf16 tolerance; fla's chunk_kda
forward and backward bitwise equal over two calls (no float atomics); two training runs bitwise equal (local
and moonep backends, all-MLA and hybrid KDA layouts); and the deterministic mode equal bitwise to torch's
strict mode (torch.use_deterministic_algorithms, which also fills every new tensor with NaN, so a read of
uninitialised memory would show).

Tolerance against SDPA, derived from bf16: both read the same bf16 inputs and accumulate in fp32; the
outputs and gradients are rounded to bf16 once (relative 2^-9) after a few roundings of bf16 intermediates
(the probabilities fed to the second GEMM), so RMS(flex - reference) <= 2^-6 RMS(reference), the fp32
reference being SDPA's math backend on the upcast inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moontrain.config import RunConfig, from_dict
from moontrain.model.documents import causal_flex_mask, compiled_flex_attention
from moontrain.model.kda.layer import fla_available
from moontrain.model.kda.ops import kda_fla
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, train
from tests.moontrain.model.kda.test_layer_gpu import _inputs
from tests.moontrain.trainer.test_determinism import restore_switches  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).square().mean().sqrt() / want.float().square().mean().sqrt()).item()


def test_flex_causal_backward_is_deterministic_and_matches_sdpa() -> None:
    B, N, T, Dqk, Dv = 2, 4, 1000, 192, 128  # MLA's head dims (k3_small), T not a multiple of 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k = (torch.randn(B, N, T, Dqk, generator=gen, **bf) for _ in range(2))
    v = torch.randn(B, N, T, Dv, generator=gen, **bf)
    go = torch.randn(B, N, T, Dv, generator=gen, **bf)
    mask = causal_flex_mask(T, CUDA)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = compiled_flex_attention()(*leaves, block_mask=mask.block_mask, scale=Dqk ** -0.5)
        runs.append((o, *torch.autograd.grad(o, leaves, go)))
    names = ("o", "dq", "dk", "dv")
    for name, a, b in zip(names, *runs, strict=True):
        assert torch.equal(a, b), f"flex_attention {name}: two runs differ"
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=Dqk ** -0.5)
    want = (o, *torch.autograd.grad(o, leaves, go.float()))
    errors = {name: _rel_rms(a, b) for name, a, b in zip(names, runs[0], want, strict=True)}
    assert max(errors.values()) <= 2.0 ** -6, errors


@pytest.mark.skipif(not fla_available(), reason="needs fla-core (bash ../shared/device/stage.sh fla)")
def test_fla_chunk_kda_is_deterministic_in_process() -> None:
    B, T, H, K = 2, 1000, 16, 128  # k3_small's heads: fla's tile choices are in recipes/data/fla_autotune_h200
    inputs = _inputs(B, T, H, K, seed=0)
    go = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    doc_start = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    doc_start[0, [64, 300]] = True
    runs = []
    for _ in range(3):  # the first call compiles (and autotunes where no choice is cached); compare the next two
        leaves = [t.detach().requires_grad_() for t in inputs]
        o = kda_fla(*leaves, lower_bound=-5.0, scale=K ** -0.5, doc_start_BT=doc_start)
        runs.append((o, *torch.autograd.grad(o, leaves, go)))
    names = ("o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias")
    for name, a, b in zip(names, runs[1], runs[2], strict=True):
        assert torch.equal(a, b), f"chunk_kda {name}: two calls differ"


def _config(backend: str, hybrid: bool, run_dir: Path) -> RunConfig:
    # epn * H * F * 2 bytes = 8 * 512 * 256 * 2 = 2 MiB: one VMM granule (moonep's GPU heap). KDA: 16 heads of
    # 128 (k3_small's), whose fla tile choices recipes/data/fla_autotune_h200 holds; other head counts autotune for minutes
    return from_dict(RunConfig, {
        "model": dict(vocab_size=512, hidden_size=512, num_layers=4, num_dense_layers=1, dense_intermediate_size=1024,
                      num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, use_nope=False, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                      moe_intermediate_size=256, routed_scaling_factor=2.0, router_bias_update_rate=0.01,
                      kda_layers_per_mla=1 if hybrid else 0, kda_num_heads=16, kda_head_dim=128),
        "experts": {"backend": backend},
        # local runs without a process group: plain dense gives them the bf16 compute of a one-GPU job (in fp32,
        # flex_attention's kernel for 192-dim heads needs more shared memory than an H200 has)
        "parallel": {"ep": 1, "dense": "plain" if backend == "local" else "fsdp"},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0},
        "train": {"steps": 3, "global_batch_size": 2, "seq_len": 1024, "seed": 3, "run_dir": str(run_dir),
                  "deterministic": True},
        "metrics": {"wandb": False},
    })


def _run(backend: str, hybrid: bool, run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = _config(backend, hybrid, run_dir)
    layout = build_layout(1, CUDA) if backend == "moonep" else single_process_layout(CUDA)
    trainer = Trainer(cfg, layout)
    try:
        assert trainer.model.deterministic_attention
        losses = train(trainer, 3)
        torch.cuda.synchronize()
        return losses, {name: t.cpu() for name, t in full_state(trainer).items()}
    finally:
        trainer.close()


CASES = [("local", False), ("moonep", False),
         pytest.param("local", True, marks=pytest.mark.skipif(not fla_available(), reason="needs fla-core"))]


@pytest.mark.parametrize("backend,hybrid", CASES)
def test_two_deterministic_runs_are_bitwise_equal(backend: str, hybrid: bool, tmp_path: Path, one_rank: None,
                                                  restore_switches: None) -> None:  # noqa: F811
    first, second = _run(backend, hybrid, tmp_path), _run(backend, hybrid, tmp_path)
    assert second[0] == first[0], f"losses {second[0]} vs {first[0]}"
    assert_bitwise(second[1], first[1], f"{backend}: two deterministic runs")


@pytest.mark.parametrize("backend,hybrid", CASES[:2])
def test_deterministic_mode_equals_torch_strict_mode(backend: str, hybrid: bool, tmp_path: Path, one_rank: None,
                                                     restore_switches: None) -> None:  # noqa: F811
    torch.use_deterministic_algorithms(False)
    fast = _run(backend, hybrid, tmp_path)
    torch.use_deterministic_algorithms(True)  # strict: sorted fallbacks, NaN-filled new tensors
    strict = _run(backend, hybrid, tmp_path)
    assert strict[0] == fast[0], f"losses {strict[0]} vs {fast[0]}"
    assert_bitwise(strict[1], fast[1], f"{backend}: deterministic mode vs strict mode")
