"""Checking a planner against the specification, for moonep's tests and benchmarks alike.

The PyTorch planner (moonep.planner.make_plan) is the specification and every other planner must
equal it bitwise on every field of the Plan (docs/moonep.md §5.6). This module holds what a check
of that needs outside a running EP group:

- `PLAN_FIELDS` and `assert_same_plan`: the comparison, naming the first field and index that
  differ (an AssertionError, as torch.testing's asserts raise);
- `simulate_fused`: every rank of an R-rank problem planned by the fused Triton planner in one
  process, on any device (the CPU through Triton's interpreter): the histograms the ranks' peer
  stores would build are written into one [R, R, E] tensor, and program order stands in for the
  barrier between the passes.

Nothing here runs in a training step; it imports triton only when `simulate_fused` is called.
"""

from __future__ import annotations

import torch

from moonep.layout import Layout
from moonep.planner import Plan

PLAN_FIELDS = ("counts_RE", "cap_R", "quota_RR", "alloc_ER", "slot_expert_RB", "group_rows_RG", "offs_RG",
               "dst_rank_sK", "dst_row_sK", "copy_row_sK", "sent_sK")


def assert_same_plan(got: Plan, want: Plan, context: str) -> None:
    """Every field of a Plan bitwise (dtype and shape included); names the first mismatch."""
    for name in ("rank", "num_ranks", "num_experts", "num_slots", "topk", "num_tokens", "nvs_s"):
        assert getattr(got, name) == getattr(want, name), f"{context}: {name} {getattr(got, name)} != {getattr(want, name)}"
    for name in PLAN_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{context}: {name} is {a.dtype}{list(a.shape)}, " \
                                                         f"expected {b.dtype}{list(b.shape)}"
        if not torch.equal(a, b):
            bad = tuple((a != b).nonzero()[0].tolist())
            raise AssertionError(f"{context}: {name} differs at {list(bad)}: fused {a[bad].item()} vs "
                                 f"make_plan {b[bad].item()}")


def simulate_fused(layout: Layout, topk_R: list[torch.Tensor], total: int | None, chunk: int | None = None
                   ) -> list[Plan]:
    """Every rank's plan from moonep.planner.fused in one process (any device): step 1 of every
    rank into one [R, R, E] hist (what the peer stores build), then steps 3-4 of each rank (program
    order stands in for the barrier)."""
    from moonep.planner import fused as pf  # imports triton

    R, E = layout.num_ranks, layout.config.num_experts
    device = topk_R[0].device
    hist_all = torch.full((R, R, E), -7, dtype=torch.int32, device=device)
    work = [pf._Workspace(layout, t.shape[0], device, chunk or pf.CHUNK) for t in topk_R]
    for r, topk in enumerate(topk_R):
        pf.chunk_pass(topk, r, hist_all, work[r])
    plans = []
    for r, topk in enumerate(topk_R):
        plan_layout = pf._PlanLayout(layout, r, topk.shape[0], total)
        flat = plan_layout.empty(device).fill_(0x5A5A5A5A)  # garbage: the kernels write every field
        cap_base, cap_rem = pf.receive_cap_args(R, layout.config.topk, topk.shape[0], total)
        pf.plan_pass(topk, r, hist_all[r], work[r], plan_layout.views(flat), layout, cap_base, cap_rem)
        plans.append(plan_layout.plan(flat))
    return plans
