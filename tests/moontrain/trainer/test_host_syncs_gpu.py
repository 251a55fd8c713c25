"""The K3 block's forward and backward on one GPU never wait for the host, on text with packed documents
(the learning row's data): under torch.cuda.set_sync_debug_mode("error") any synchronising call raises. Each
sync the step had (docs/performance.md, 2026-12-02) starved the GPU for ~14 ms: the rope table rebuilt from
the host every forward, the documents' cu_seqlens found with nonzero and copied back, fla's chunk list
built on the host and copied with a blocking copy. The whole pipelined step (Trainer.fit's: clip, verdict,
fused optimizer, router balancing, metrics; its host reads taken in the next step, moontrain.trainer.guard)
is checked the same way, its deferred reads taken after.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain.config import RunConfig, from_dict
from moontrain.model.kda.layer import fla_available
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fla_available(), reason="needs fla-core (bash ../shared/device/stage.sh fla)")]

CUDA = torch.device("cuda", 0)
CORPUS = Path(__file__).resolve().parents[3] / "recipes/data/tiny_corpus.jsonl"


def _config(run_dir: Path) -> RunConfig:
    # KDA: 16 heads of 128 (k3_small's: fla's tile choices are shipped in recipes/data/fla_autotune_h200);
    # moonep's heap wants epn * H * F * 2 bytes a multiple of 2 MiB: 8 * 512 * 256 * 2
    return from_dict(RunConfig, {
        "model": dict(vocab_size=512, hidden_size=512, num_layers=4, num_dense_layers=1, dense_intermediate_size=1024,
                      num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                      moe_intermediate_size=256, routed_scaling_factor=2.0, kda_layers_per_mla=1, kda_num_heads=16,
                      kda_head_dim=128),
        "experts": {"backend": "moonep"},
        "parallel": {"ep": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 1024, "seed": 0,
                  "run_dir": str(run_dir)},
        "data": {"source": "dataset", "path": str(CORPUS), "tokenizer": "bytes"},
        "checkpoint": {"save_final": False}, "metrics": {"wandb": False},
    })


def test_forward_and_backward_on_documents_never_sync(tmp_path: Path, one_rank: None) -> None:
    trainer = Trainer(_config(tmp_path), build_layout(1, CUDA))
    try:
        model = trainer.model
        assert model.fla_seq_bounds and model.document_eos_id is not None
        trainer.train_step()  # compiles and autotunes (which synchronise); the step after is the steady one
        tokens_BT, targets_BT = trainer.data.batch(trainer.step)
        host_BT = trainer.data.host_tokens
        assert int((host_BT == model.document_eos_id).sum()) > tokens_BT.shape[0], "the rows must pack documents"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for tok, tgt, host in zip(tokens_BT.chunk(2), targets_BT.chunk(2), host_BT.chunk(2), strict=True):
                loss, _ = model(tok, tgt, host_tokens_BT=host)
                loss.backward()
                del loss
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    finally:
        trainer.close()


def test_pipelined_steps_never_sync(tmp_path: Path, one_rank: None) -> None:
    trainer = Trainer(_config(tmp_path), build_layout(1, CUDA))
    try:
        assert trainer.optimizer.skips_on_device, "the GPU default (fused AdamW with write-back) skips on the device"
        trainer.cfg.metrics.heatmap_every = 0  # a heatmap step reads the expert counts at once
        trainer.train_step()  # compiles and autotunes (which synchronise)
        torch.cuda.synchronize()
        stats = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                stats += trainer._train_step(defer=True)  # the second takes the first's reads (an event wait)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        stats += trainer._take_deferred()
        assert [s.step for s in stats] == [2, 3] and all(s.loss == s.loss for s in stats)
    finally:
        trainer.close()
