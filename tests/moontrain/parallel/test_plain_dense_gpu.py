"""parallel.dense=plain against FSDP2 at world size 1 on one GPU: bitwise, with train.compile.

The CPU test (test_plain_dense.py) runs eagerly; here the K3 block (SiTU-GLU, AttnRes, hybrid KDA when
fla-core is installed, else all-MLA; plain with parallel.plain_accumulate torch and triton) trains in bf16 with train.compile's regions compiled, moonep at EP = 1
in a one-rank NCCL group, 2 accumulated passes per step, clipping and QK-Clip active, AdamW (fused) and
Muon. Deterministic mode (train.deterministic) makes two runs of either strategy repeatable, so any
difference is the strategy's: losses, grad norms and every state tensor must be equal after 3 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain.config import RunConfig, from_dict
from moontrain.model.kda.layer import fla_available
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state
from tests.moontrain.trainer.test_determinism import restore_switches  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


def _config(dense: str, optim: str, run_dir: Path, accumulate: str = "torch") -> RunConfig:
    # epn * H * F * 2 bytes = 8 * 512 * 256 * 2 = 2 MiB: one VMM granule (moonep's GPU heap). KDA: 16 heads of
    # 128 (k3_small's), whose fla tile choices recipes/data/fla_autotune_h200 holds; other head counts autotune for minutes
    return from_dict(RunConfig, {
        "model": dict(vocab_size=512, hidden_size=512, num_layers=4, num_dense_layers=1, dense_intermediate_size=1024,
                      num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                      moe_intermediate_size=256, routed_scaling_factor=2.0, router_bias_update_rate=0.01,
                      kda_layers_per_mla=1 if fla_available() else 0, kda_num_heads=16, kda_head_dim=128,
                      ffn_activation="situ_glu", attn_res_block_size=2),
        "experts": {"backend": "moonep"},
        "parallel": {"ep": 1, "dense": dense, "fsdp_reshard_after_forward": False, "plain_accumulate": accumulate},
        # the dense write-back steps the masters in moontrain's kernel (a few ulps from torch's): off for the bitwise claim
        "optim": {"name": optim, "lr": 3e-3, "warmup_steps": 1, "grad_clip": 0.05, "qk_clip_tau": 0.5,
                  "write_back_dense": False if optim == "adamw" else None},
        "train": {"steps": 3, "global_batch_size": 2, "micro_batch_size": 1, "seq_len": 1024, "seed": 3,
                  "run_dir": str(run_dir), "deterministic": True, "compile": True},
        "metrics": {"wandb": False},
    })


def _run(dense: str, optim: str, run_dir: Path, accumulate: str = "torch"
         ) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    trainer = Trainer(_config(dense, optim, run_dir, accumulate), build_layout(1, CUDA))
    try:
        assert trainer.accumulation_steps == 2 and (trainer.plain_dense is not None) == (dense == "plain")
        log: dict[str, list[float]] = {"loss": [], "grad_norm": [], "qk_clipped": []}
        for _ in range(3):
            stats = trainer.train_step()
            log["loss"].append(stats.loss)
            log["grad_norm"].append(stats.grad_norm)
            log["qk_clipped"].append(stats.scalars["qk/clipped_heads/total"])
        torch.cuda.synchronize()
        return log, {name: t.cpu() for name, t in full_state(trainer).items()}
    finally:
        trainer.close()


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.usefixtures("one_rank", "restore_switches")
def test_plain_equals_fsdp_compiled_on_one_gpu(optim: str, tmp_path: Path) -> None:
    f_log, f_state = _run("fsdp", optim, tmp_path)
    p_log, p_state = _run("plain", optim, tmp_path)
    assert min(f_log["grad_norm"]) > 0.05, f"clipping must be active (grad_clip 0.05): {f_log}"
    assert p_log == f_log, (p_log, f_log)
    assert_bitwise(p_state, f_state, f"plain vs fsdp on the GPU ({optim})")


@pytest.mark.usefixtures("one_rank", "restore_switches")
def test_plain_with_the_triton_accumulate_equals_fsdp_on_one_gpu(tmp_path: Path) -> None:
    """parallel.plain_accumulate=triton (moontrain.parallel.grad_accumulate_kernel): the same bits as FSDP."""
    f_log, f_state = _run("fsdp", "adamw", tmp_path)
    p_log, p_state = _run("plain", "adamw", tmp_path, accumulate="triton")
    assert p_log == f_log, (p_log, f_log)
    assert_bitwise(p_state, f_state, "plain (triton accumulate) vs fsdp on the GPU")
