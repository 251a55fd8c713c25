"""The fused planner's pool of graph-written Plans: per shape, CUDA graphs whose replays write into
pooled Plans, and the reference count that says when a handed-out Plan may be overwritten (nothing
outside the pool holds it, one of its tensors, or a view of them: a Plan saved for backward is never
reused). The planner's side (capture, replay) is moonep.planner.fused.FusedPlanner."""

from __future__ import annotations

import sys
from typing import Protocol

import torch

from moonep.planner.plan import Plan


class PlanLayoutLike(Protocol):
    def plan(self, flat: torch.Tensor) -> Plan:
        """The Plan whose tensors are views of `flat`."""


class PooledPlan:
    """One graph of a pool and the Plan its replay writes (views of `flat`)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, flat: torch.Tensor, plan: Plan) -> None:
        self.graph, self.flat, self.plan = graph, flat, plan
        self.tensors = tuple(v for v in vars(plan).values() if isinstance(v, torch.Tensor))
        self.free_holds = self._holds()  # the pool's own references (nothing else exists yet)

    def _holds(self) -> int:
        """References to the plan's tensors: Python references, C++ references (autograd saves),
        and other tensors on the same storage (views)."""
        return storage_uses(self.flat) + sum(sys.getrefcount(t) + t._use_count() for t in self.tensors)

    def is_free(self) -> bool:
        """Nothing outside the pool holds the Plan (getrefcount: the attribute and its own
        argument), one of its tensors, or a view of them."""
        return sys.getrefcount(self.plan) <= 2 and self._holds() <= self.free_holds


class PlanPool:
    """Graphs of one shape whose replays write into pooled Plans, reused once the caller has
    dropped every reference to a Plan and its tensors (so a held plan, e.g. saved for backward, is
    never overwritten). A call then costs one input copy and one replay: no clone, no views."""

    def __init__(self, topk_in: torch.Tensor, layout: PlanLayoutLike) -> None:
        self.topk_in, self.layout = topk_in, layout
        self.entries: list[PooledPlan] = []

    def take(self) -> PooledPlan | None:
        for i, entry in enumerate(self.entries):  # least recently used first: the likeliest free
            if entry.is_free():
                self.entries.append(self.entries.pop(i))
                return entry
        return None

    def release(self, entry: PooledPlan) -> None:
        """An entry that was captured but not handed out (it stays first in line)."""
        self.entries.remove(entry)
        self.entries.insert(0, entry)


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors share t's storage (views included; the temporary storage object of this
    call is not counted)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1
