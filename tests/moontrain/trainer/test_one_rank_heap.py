"""Training at EP = 1 on moonep's one-rank heap (no slot or reduce pool, epn receive groups: docs/moonep.md
§4.2) is bitwise the training on the heap sized as for R > 1 (B = epn slot and reduce rows, 2 epn receive
groups), which the planner never touches on one rank: losses, every parameter and optimizer state after
three steps.

Reference: the same run with moonep.layout.remote_experts forced to epn (the old sizing), in one process.
"""

from __future__ import annotations

from pathlib import Path

import moonep.layout
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train
from tests.moontrain.trainer.test_determinism import CPU

STEPS = 3


def _run(run_dir: Path) -> tuple[list[float], dict, int, int, int]:
    trainer = Trainer(small_config("moonep", 1, steps=STEPS, run_dir=str(run_dir)), build_layout(1, CPU))
    try:
        buf = trainer.experts_runtime.buffer
        heap = (buf.layout.num_slots, buf.layout.nvs, buf.heap.local_bytes)
        losses = train(trainer, STEPS)
        return losses, full_state(trainer), *heap
    finally:
        trainer.close()


def _both_sizings(rank: int, world: int, run_dir: str) -> None:
    losses, state, slots, nvs, heap_bytes = _run(Path(run_dir) / "one_rank")
    sized_for_peers = moonep.layout.remote_experts
    moonep.layout.remote_experts = lambda num_experts, num_ranks: num_experts // num_ranks
    try:
        old_losses, old_state, old_slots, old_nvs, old_heap_bytes = _run(Path(run_dir) / "sized_for_peers")
    finally:
        moonep.layout.remote_experts = sized_for_peers
    # small_config: E = 8 experts of 32 x 64 (latent 32), K = 2, S = 4 x 16 tokens, token_padding 16, fp32 on
    # the CPU. NvS = round_up(S*K + groups * 15, 16) with 8 groups (one rank) or 16 (sized for peers); the
    # pools the one-rank heap leaves out are 8 rows x 3 projections x 32 x 64 x (4 + 4) bytes
    assert (slots, old_slots) == (0, 8)
    assert (nvs, old_nvs) == (256, 368)  # round_up(128 + 120, 16), round_up(128 + 240, 16)
    assert old_heap_bytes - heap_bytes >= 8 * 3 * 32 * 64 * (4 + 4)
    assert losses == old_losses, (losses, old_losses)
    assert_bitwise(state, old_state, "EP = 1 on the one-rank heap vs the heap sized for peers")


def test_one_rank_heap_trains_bitwise_like_the_heap_sized_for_peers(tmp_path: Path) -> None:
    run_ranks(_both_sizings, 1, str(tmp_path), timeout_s=300)
