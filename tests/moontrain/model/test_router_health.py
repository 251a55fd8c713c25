"""Router health on text: the routing is not collapsed at init, and it stays balanced over the first steps.

Collapse is every token on the same K experts: expert maxvio E/K - 1 (7 here). Text is not uniform (a few
tokens are most of the corpus and each token type routes alike), so a healthy router on text sits near
1-2, not at 0. Each test also runs the configuration the fix replaced (docs/learning.md) and asserts that
it collapses: the tests can fail, and they fail for the cause that was found.

- At init: a DeepSeek-V3 block (hidden 256, k3_small_moe's attention, 32 experts top-4) reads one
  1024-token row of the learning corpus through its BPE tokenizer. Measured: max maxvio over the MoE layers 0.84 with moontrain.model.init,
  6.95 with the previous scheme (every matrix and the embedding N(0, 0.02^2)). Bounds: < 2.5 now, > 5 before.
- Over the first steps: hidden 128, 16 experts top-2, lr 3e-3, the learning corpus as bytes, 40 steps.
  Measured: max over steps 20-40 1.5 with the balancing as configured now (mean-free router updates and
  the proportional bias update at 1e-2), 7.0 (collapse) from step 27 with the replaced one (plain
  router updates and DeepSeek-V3's sign update at 1e-3). Each half alone: 2.6. Bounds: < 2.5 now,
  >= 6 before.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.bench_learning import previous_init
from moontrain.config import RunConfig, from_dict
from moontrain.metrics.balance import maxvio_L
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
LEARNING = ROOT / "recipes/data/learning"
CPU = torch.device("cpu")


def _config(model: dict, data: dict, run_dir: Path, steps: int, seq_len: int, batch: int) -> RunConfig:
    return from_dict(RunConfig, {
        "model": model, "experts": {"backend": "local"}, "parallel": {"ep": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 5, "min_lr_ratio": 0.1, "weight_decay": 0.1},
        "train": {"steps": steps, "global_batch_size": batch, "seq_len": seq_len, "seed": 0, "log_every": 1,
                  "run_dir": str(run_dir)},
        "data": {"source": "dataset", "prefetch": 0, "path": str(LEARNING / "corpus.jsonl"), **data},
        "checkpoint": {"save_final": False}, "metrics": {"wandb": False}})


def _init_maxvio(tmp_path: Path, previous: bool) -> float:
    # k3_small_moe's attention (16 heads, 128/64 head dims, ranks 512/256) on a narrower stream: the sublayers'
    # fan-in, not the stream's width, sets how much a 0.02 init adds to a 0.02 embedding
    model = dict(vocab_size=32768, hidden_size=256, num_layers=3, num_dense_layers=1, dense_intermediate_size=1024,
                 num_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, attn_output_gate=False, num_experts=32, num_experts_per_tok=4, num_shared_experts=1,
                 moe_intermediate_size=256, routed_scaling_factor=2.5)
    trainer = Trainer(_config(model, {"tokenizer": str(LEARNING / "tokenizer")}, tmp_path, 1, 1024, 1),
                      single_process_layout(CPU))
    try:
        if previous:
            previous_init(trainer)
        tokens, targets = trainer.data.batch(0)
        with torch.no_grad():
            trainer.model(tokens, targets)
        return float(maxvio_L(torch.stack([m.router.tokens_per_expert_E for m in trainer.model.moe_layers()])).max())
    finally:
        trainer.close()


def test_routing_is_not_collapsed_at_init_on_text(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    now, before = _init_maxvio(tmp_path / "a", False), _init_maxvio(tmp_path / "b", True)
    assert now < 2.5, f"expert maxvio {now:.2f} at init (collapse: 7)"
    assert before > 5.0, f"the previous init scheme gave {before:.2f}: the probe no longer sees its collapse"


def _maxvio_per_step(tmp_path: Path, **balancing) -> list[float]:
    model = dict(vocab_size=257, hidden_size=128, num_layers=3, num_dense_layers=1, dense_intermediate_size=256,
                 num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, attn_output_gate=False, num_experts=16, num_experts_per_tok=2, num_shared_experts=1,
                 moe_intermediate_size=64, routed_scaling_factor=2.5, **balancing)
    trainer = Trainer(_config(model, {"tokenizer": "bytes"}, tmp_path, 40, 256, 8), single_process_layout(CPU))
    try:
        return [trainer.train_step().max_maxvio for _ in range(40)]
    finally:
        trainer.close()


def test_routing_stays_balanced_over_the_first_steps(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    now = _maxvio_per_step(tmp_path / "a")
    before = _maxvio_per_step(tmp_path / "b", router_mean_free_updates=False, router_bias_update="sign",
                              router_bias_update_rate=1e-3)
    assert max(now[19:]) < 2.5, f"expert maxvio per step {[round(v, 2) for v in now]} (collapse: 7)"
    assert max(before[24:]) >= 6.0, (f"with the replaced balancing the router no longer collapses "
                                     f"({[round(v, 2) for v in before]}): the test no longer sees the cause")
