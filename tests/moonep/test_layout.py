"""moonep.Layout sizes a job without a process group: its byte counts equal what a Buffer and its
ExpertPools allocate in the symmetric heap (a dry run asks moonep instead of re-deriving them)."""

from __future__ import annotations

import torch

from moonep import Buffer, BufferConfig, ExpertPools, Layout, glu_projections, receive_rows
from tests.dist_utils import run_ranks

CFG = BufferConfig(max_tokens=24, hidden=32, topk=3, num_experts=8, token_padding=4)
PROJ = glu_projections(32, 64)  # (32, 64) in bf16 is one 4096-byte page of the CPU heap


def _allocated(rank: int, world: int) -> dict[str, int]:
    buf = Buffer(CFG)
    try:
        comm = buf.heap.local_bytes
        ExpertPools(buf, PROJ)
        return {"comm": comm, "pools": buf.heap.local_bytes - comm, "granularity": buf.heap.granularity,
                "nvs": buf.layout.nvs}
    finally:
        buf.destroy()


def test_layout_bytes_equal_the_heap_allocations() -> None:
    got = run_ranks(_allocated, 1, timeout_s=120)[0]
    layout = Layout(CFG, 1, got["granularity"])
    assert got["comm"] == layout.comm_bytes
    assert got["pools"] == layout.slot_pool_bytes(PROJ)
    # unrounded (granularity 1) for estimates: the comm segment less at most one page of rounding
    assert 0 <= layout.comm_bytes - Layout(CFG, 1).comm_bytes < got["granularity"]
    assert got["nvs"] == receive_rows(24, 3, 8, 1, 4) == 24 * 3 + 2 * 8 * 3  # a multiple of 4 already


def test_slot_pool_bytes_by_hand() -> None:
    layout = Layout(CFG, 2)  # epn = B = 4
    assert layout.slot_pool_bytes(PROJ) == 4 * 3 * 32 * 64 * (2 + 4)
    assert layout.slot_pool_bytes(PROJ, torch.float32) == 4 * 3 * 32 * 64 * (4 + 4)
