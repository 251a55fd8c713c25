"""moontrain's trainer against a reference trainer: benchmarks/reference_loop.py, a plain PyTorch loop over
transformers' DeepseekV3ForCausalLM that shares no code with moontrain.

Both start from the same weights (transformers initialises and saves the model; moontrain imports the
directory, the only moontrain code on the reference's side of the comparison) and read the same text:
the shipped learning corpus as bytes, documents in file order. Over 60 steps of AdamW with warmup,
cosine decay, weight decay groups, global-norm clipping, the router-bias update and the mean-free router
updates, moontrain's per-step loss, grad norm and expert maxvio equal the reference's. This checks the
data path (packing, targets, EOS), the loss, the optimizer and its groups, clipping, the schedule and the
routing updates against an independent implementation of each.

Tolerance: both sides compute in fp32 on the CPU; they differ only in summation order (attention, expert
combine, reductions, the fused head's chunked sums), measured at <= 1e-6 on the loss (~4 ulps at loss
2-6) and <= 4.5e-5 relative on the grad norm (a sum of squares over every gradient, most sensitive on a
spiky step) over 60 steps. The bounds
are 1e-5 absolute on the loss and 1e-4 relative on the grad norm, far below what a wrong step would change
(one skipped warmup step moves the loss by > 1e-2 within 5 steps). Expert maxvio is compared
exactly in one process (the same routing decisions), within 1e-9 at EP = 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.reference_loop import LoopConfig, sharded_batches
from benchmarks.reference_loop import train as reference_train
from moontrain.checkpoint import init_weights_from, read_hf
from moontrain.config import RunConfig, from_dict
from moontrain.config.loader import to_dict
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "recipes/data/learning/corpus.jsonl"
CPU = torch.device("cpu")
STEPS, BATCH, SEQ, LR = 60, 4, 64, 3e-3


def _hf_model(path: Path) -> None:
    cfg = transformers.DeepseekV3Config(
        vocab_size=257, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).float().save_pretrained(path)


def _config(hf_dir: Path, run_dir: Path, backend: str, ep: int) -> RunConfig:
    model = {**to_dict(read_hf(hf_dir)[0]), "router_bias_update_rate": 1e-2, "router_bias_update": "proportional"}
    return from_dict(RunConfig, {
        "model": model, "experts": {"backend": backend}, "parallel": {"ep": ep},
        "optim": {"lr": LR, "warmup_steps": 5, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"steps": STEPS, "global_batch_size": BATCH, "seq_len": SEQ, "seed": 0, "run_dir": str(run_dir),
                  "log_every": 1},
        "data": {"source": "dataset", "path": str(CORPUS), "tokenizer": "bytes", "shuffle": False, "prefetch": 0},
        "checkpoint": {"save_final": False}, "metrics": {"wandb": False}})


def _moontrain(cfg: RunConfig, hf_dir: Path, layout) -> list[tuple[float, float, float]]:
    trainer = Trainer(cfg, layout)
    try:
        init_weights_from(trainer.state, hf_dir)
        trainer.model.document_eos_id = None  # transformers' model reads each row as one sequence
        out = []
        for _ in range(STEPS):
            s = trainer.train_step()
            out.append((s.loss, s.grad_norm, s.max_maxvio))
        return out
    finally:
        trainer.close()


def _reference(hf_dir: Path, world: int = 1) -> list[dict]:
    """The reference loop on the rows moontrain's `world` data-parallel ranks read together."""
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    data = sharded_batches(CORPUS, lambda text: list(text.encode()), 256, world, BATCH, SEQ)
    return reference_train(model, data, LoopConfig(lr=LR, warmup_steps=5, steps=STEPS, batch=BATCH, seq_len=SEQ,
                                                   bias_update_rate=1e-2, bias_update="proportional"),
                           device=CPU)


def _compare(mine: list[tuple[float, float, float]], ref: list[dict], maxvio_tol: float) -> None:
    for step, ((loss, grad_norm, maxvio), r) in enumerate(zip(mine, ref, strict=True), start=1):
        assert abs(loss - r["loss"]) <= 1e-5, f"step {step}: loss {loss:.7f} vs reference {r['loss']:.7f}"
        assert abs(grad_norm - r["grad_norm"]) <= 1e-4 * r["grad_norm"], (
            f"step {step}: grad norm {grad_norm:.7f} vs reference {r['grad_norm']:.7f}")
        assert abs(maxvio - r["maxvio"]) <= maxvio_tol, f"step {step}: maxvio {maxvio} vs reference {r['maxvio']}"
    assert ref[-1]["loss"] < ref[0]["loss"] - 2.0  # both learn: the comparison is not of two flat lines


def test_trainer_matches_the_reference_loop(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _hf_model(tmp_path / "hf")
    mine = _moontrain(_config(tmp_path / "hf", tmp_path / "run", "local", 1), tmp_path / "hf",
                      single_process_layout(CPU))
    _compare(mine, _reference(tmp_path / "hf"), maxvio_tol=0.0)


def _rank(rank: int, world: int, hf_dir: str, run_dir: str) -> list[tuple[float, float, float]]:
    return _moontrain(_config(Path(hf_dir), Path(run_dir), "moonep", 2), Path(hf_dir), build_layout(2, CPU))


def test_trainer_at_ep2_with_moonep_matches_the_reference_loop(tmp_path: Path) -> None:
    """Two ranks (moonep, FSDP): each rank packs its own documents (every second one); the reference reads
    the same rows and gives the same per-step numbers."""
    _hf_model(tmp_path / "hf")
    mine = run_ranks(_rank, 2, str(tmp_path / "hf"), str(tmp_path / "run"), timeout_s=300)
    assert mine[0] == mine[1]
    torch.set_num_threads(1)
    _compare(mine[0], _reference(tmp_path / "hf", world=2), maxvio_tol=1e-9)
