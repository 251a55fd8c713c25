"""moonep.Layout sizes a job without a process group: every heap region is sized from what the planner
can use (no slot or reduce pool on one rank, epn + remote_experts padded receive groups), the sizes are
those derived by hand here, and they equal what a Buffer and its ExpertPools allocate in the symmetric
heap (a dry run asks moonep instead of re-deriving them)."""

from __future__ import annotations

import pytest
import torch

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, Layout, glu_projections, receive_rows
from moonep.layout import round_up
from tests.dist_utils import run_ranks

CFG = BufferConfig(max_tokens=24, hidden=32, topk=3, num_experts=8, token_padding=4)
PROJ = glu_projections(32, 64)  # gate_up (32, 128) and down (64, 32) in bf16: 2 and 1 4096-byte pages of the CPU heap
LAYERS = 2
EXPERT = 3 * 32 * 64  # elements of one expert over the three projections


def _up(n: int) -> int:  # regions start on 256-byte boundaries
    return -(-n // 256) * 256


def _comm_by_hand(R: int, nvs: int) -> int:
    """The comm segment of CFG (H = 32, bf16 rows; S*K = 72 landing rows), region by region."""
    H, SK, E = 32, 24 * 3, 8
    rows = 2 * _up((nvs + 2) * H * 2)  # recv, comb
    meta = _up(R * E * 4) + 3 * _up((nvs + 1) * 4) + _up((nvs + 1) * 8)  # hist, row_weight/chain/scalar, row_link
    return rows + meta + _up((SK + 1) * H * 2) + _up((SK + 1) * 4)  # land, land_scalar


# R -> (epn, B, NvS): one rank has no remote expert (B = 0, epn groups); R > 1 receives from at most
# one remote home group (B = epn, 2 epn groups), each group padded by up to token_padding - 1 = 3 rows
BY_HAND = {1: (8, 0, 72 + 8 * 3), 2: (4, 4, 72 + 8 * 3), 4: (2, 2, 72 + 4 * 3)}


@pytest.mark.parametrize("R", sorted(BY_HAND))
def test_heap_regions_by_hand(R: int) -> None:
    epn, B, nvs = BY_HAND[R]
    layout = Layout(CFG, R)
    assert (layout.epn, layout.num_slots, layout.remote_experts, layout.nvs) == (epn, B, B, nvs)
    assert receive_rows(24, 3, 8, R, 4) == nvs
    assert layout.heap_bytes(PROJ, LAYERS) == {
        "comm": _comm_by_hand(R, nvs),
        "weights": LAYERS * epn * EXPERT * 2, "grads": LAYERS * epn * EXPERT * 4,
        "slot_pool": B * EXPERT * 2, "reduce_pool": B * EXPERT * 4}
    assert layout.heap_bytes(PROJ, LAYERS, torch.float32)["slot_pool"] == B * EXPERT * 4


def test_one_rank_has_no_slot_rows() -> None:
    """At R = 1 the pools add nothing to the weights and grads, and an explicit B is still honoured."""
    pools = Layout(CFG, 1).heap_bytes(PROJ, LAYERS)
    assert pools["slot_pool"] == pools["reduce_pool"] == 0
    explicit = Layout(BufferConfig(max_tokens=24, hidden=32, topk=3, num_experts=8, token_padding=4, num_slots=2), 1)
    assert explicit.num_slots == 2 and explicit.remote_experts == 0


def _combine_input_error(rank: int, world: int) -> str:
    buf = Buffer(DEST)
    try:
        topk = torch.arange(3).repeat(24, 1)  # every token to experts 0, 1, 2
        plan = buf.plan(topk, torch.tensor([24, 24, 24, 0, 0, 0, 0, 0]))
        with pytest.raises(ValueError) as err:
            buf.combine_input(plan)
        return str(err.value)
    finally:
        buf.destroy()


DEST = BufferConfig(max_tokens=24, hidden=32, topk=3, num_experts=8, token_padding=4,
                    options=BufferOptions(combine_reduce="destination"))


def test_destination_combine_has_no_combine_rows() -> None:
    """combine_reduce "destination" pushes from the caller's rows into the landing rows: the comm segment
    has no comb region (NvS + 2 rows of H), and Buffer.combine_input says why it has none."""
    src, dst = Layout(CFG, 1), Layout(DEST, 1)
    assert "comb" in src.comm and "comb" not in dst.comm
    assert src.comm_bytes - dst.comm_bytes == round_up(src.comm["comb"].nbytes, 256)
    (msg,) = run_ranks(_combine_input_error, 1, timeout_s=60)
    assert "combine_reduce='destination'" in msg and "no combine rows" in msg, msg


def _allocated(rank: int, world: int) -> dict[str, int]:
    buf = Buffer(CFG)
    try:
        comm = buf.heap.local_bytes
        pools = ExpertPools(buf, PROJ)
        slots = buf.heap.local_bytes - comm
        for _ in range(LAYERS):
            pools.add_layer()
        return {"comm": comm, "slots": slots, "layers": buf.heap.local_bytes - comm - slots,
                "granularity": buf.heap.granularity, "nvs": buf.layout.nvs,
                "w_compact": tuple(pools.layers[0].w_compact["gate_up"].shape),
                "g_slots_all": tuple(pools.g_slots_all["down"].shape)}
    finally:
        buf.destroy()


@pytest.mark.parametrize("R", [1, 2])
def test_layout_bytes_equal_the_heap_allocations(R: int) -> None:
    epn, B, nvs = BY_HAND[R]
    for got in run_ranks(_allocated, R, timeout_s=120):
        layout = Layout(CFG, R, got["granularity"])
        want = layout.heap_bytes(PROJ, LAYERS)
        assert got["comm"] == layout.comm_bytes == want["comm"]
        assert got["slots"] == want["slot_pool"] + want["reduce_pool"] == B * EXPERT * 6
        assert got["layers"] == want["weights"] + want["grads"]
        assert got["nvs"] == nvs
        assert got["w_compact"] == (epn + B, 32, 128) and got["g_slots_all"] == (R, B, 64, 32)
        # unrounded (granularity 1) for estimates: the comm segment less at most one page of rounding
        assert 0 <= layout.comm_bytes - Layout(CFG, R).comm_bytes < got["granularity"]
