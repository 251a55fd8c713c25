"""The fused planner's pool of graph-written Plans (moonep.planner.plan_pool.PlanPool) hands an
entry out again only when nothing outside the pool holds its Plan or any of its tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

# first: sets TRITON_INTERPRET=1 before triton is imported (the pool's kernels run in the interpreter on
# the CPU), so the module passes alone as well as after the other interpreted tests
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moonep import BufferConfig
from moonep.layout import Layout
from moonep.planner import fused as plan_fused
from moonep.planner import plan_pool


class _SaveIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * 2, None


def _pool(entries: int) -> plan_pool.PlanPool:
    layout = plan_fused._PlanLayout(Layout(BufferConfig(max_tokens=16, hidden=8, topk=2, num_experts=8), 2, 4096),
                                    0, 16, None)
    pool = plan_pool.PlanPool(torch.zeros(16, 2, dtype=torch.int32), layout)
    for _ in range(entries):
        flat = layout.empty(torch.device("cpu"))
        pool.entries.append(plan_pool.PooledPlan(None, flat, layout.plan(flat)))
    return pool


def test_entry_is_free_only_without_outside_references() -> None:
    pool = _pool(1)
    entry = pool.entries[0]
    assert entry.is_free()
    holders = {
        "the Plan": lambda p: p,
        "a field tensor": lambda p: p.dst_row_sK,
        "a view of a field": lambda p: p.offs_RG[0],
        "a dtype view": lambda p: p.quota_RR.view(torch.int32),
        "a copy of the Plan": lambda p: dataclasses.replace(p),
        "an autograd save": lambda p: _SaveIndex.apply(torch.ones(2, requires_grad=True), p.cap_R),
    }
    for what, hold in holders.items():
        held = hold(entry.plan)
        assert not entry.is_free(), f"entry handed out while the caller holds {what}"
        del held
        assert entry.is_free(), f"entry still marked in use after the caller dropped {what}"


def test_take_reuses_least_recently_used_free_entry() -> None:
    pool = _pool(3)
    a, b, c = pool.entries
    held = b.plan
    assert pool.take() is a  # oldest free first, moved to the back
    assert pool.entries == [b, c, a]
    assert pool.take() is c  # b is held
    kept = (a.plan, c.plan)
    assert pool.take() is None  # every entry held: the caller captures a new one
    del held, kept
    assert pool.take() is b
