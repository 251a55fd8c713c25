"""The interface of moonep's data paths (see moonep.datapath): what a path needs of its Buffer
(CommViews) and what it provides (DataPath).

Legend: s tokens of this rank, K top-k, H hidden, E experts, B slots, I/O an expert matrix's in/out
features, G groups of the grouped GEMM, nvs_s rows of this call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from moonep.config import BufferOptions, CombineReduce
from moonep.layout import Layout
from moonep.planner.plan import Plan


@dataclass(frozen=True, slots=True, eq=False)
class CommViews:
    """What a path needs of its Buffer: sizes, this rank, the symmetric comm region as views, and the
    Buffer's barrier. `every[name]` is [R, ...] (every rank's region, peers reachable by index),
    `mine[name]` this rank's; Buffer.destroy() empties both dicts."""

    layout: Layout
    rank: int
    device: torch.device
    options: BufferOptions
    every: dict[str, torch.Tensor]
    mine: dict[str, torch.Tensor]
    barrier: Callable[[str], None]


class DataPath(Protocol):
    name: str  # "torch" or "triton"
    # plan() counts the histogram from topk_sK itself (tokens_per_expert_E is then not read)
    counts_topk: bool
    # where combine sums a token's rows (BufferOptions.combine_reduce, fixed when the path is built); with
    # "destination" combine is also where row_weights multiply and add_rows add, in fp32 as it sums
    combine_reduce: CombineReduce

    # ------------------------------------------------------------------ Buffer
    def plan(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None, total_num_tokens: int | None,
             check_counts: Callable[[torch.Tensor], None] | None) -> Plan:
        """Collective: exchange histograms (barrier "dispatch:histograms") and plan; `check_counts`
        sees the gathered [R, E] histograms before anything depends on them."""
        ...

    def scatter(self, plan: Plan, x_sH: torch.Tensor, weights_sK: torch.Tensor | None) -> None:
        """Dispatch, sender side: token rows, route weights and row metadata into the destinations'
        receive regions (the Buffer's barrier "dispatch:rows" follows)."""
        ...

    def expand(self, plan: Plan) -> None:
        """Dispatch, receiver side, after the barrier: recv[:nvs_s] holds every row (duplicates
        copied from their primary row, padding rows zero, padding weights 0)."""
        ...

    def combine(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None,
                row_weights: torch.Tensor | None = None, add_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Collective: each token's K row values (y (+ add_rows) (* row_weights), fp32) summed in fp32
        on its source rank in the order of BufferOptions.combine_reduce -> (y_sH, scalars_sK), with
        every barrier of the path's protocol."""
        ...

    def pooled_plans(self) -> int:
        """Plans the planner keeps for reuse (0 where it keeps none)."""
        ...

    # ------------------------------------------------------------------ ExpertPools
    def prefetch(self, plan: Plan, w_full: torch.Tensor) -> None:
        """w_full [E + B, I, O]: copy the owner's row of the expert in each slot of this rank into
        row E + slot (rows of empty slots: any value)."""
        ...

    def reduce_into_owner(self, plan: Plan, g_local: torch.Tensor, g_slots_all: torch.Tensor) -> None:
        """g_local [epn, I, O] fp32 += every peer slot holding one of this rank's experts, ascending
        (rank, slot): g_slots_all [R, B, I, O], every rank's reduce pool."""
        ...

    def zero_slots(self, plan: Plan, g_slots_all: torch.Tensor) -> None:
        """Zero this rank's reduce slots that `plan` filled (the others are zero already)."""
        ...

    def accumulate_wgrad(self, g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor,
                         offs_G: torch.Tensor, scale: float, write_groups: int) -> None:
        """g (fp32) += scale * x^T grad per group of rows (offs_G cumulative ends); the first
        `write_groups` groups hold stale values and get scale * x^T grad (zero when empty) instead."""
        ...

    # ------------------------------------------------------------------ expert math (moonep.expert_glu)
    def grouped_mm(self, x_rows: torch.Tensor, w_GIO: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        """y[rows of g] = x[rows of g] @ w[g] (offs_G cumulative ends; w may be a transposed view) in x's
        dtype; rows past offs_G[-1]: any value."""
        ...

    def gate_up(self, activation: str, x_rows: torch.Tensor, w_gate_up: torch.Tensor, offs_G: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, hu) with hu = x W_gate_up[g] [rows, 2F] on the rows of group g (one grouped GEMM, bf16): its halves
        are h = x W_gate and u = x W_up (moonep.moe), and a = f(h, u) (glu_forward); rows past offs_G[-1]: any
        value."""
        ...

    def glu_forward(self, activation: str, hu: torch.Tensor) -> torch.Tensor:
        """a = f(h, u) for the registered activation (moonep.activation), h | u the halves of hu's rows."""
        ...

    def glu_route_backward(self, activation: str, g: torch.Tensor, hu: torch.Tensor, w_rows: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For y_rows = w * (f(h, u) W_down), from g = gy W_down^T: (grad_hu = grad_h | grad_u [rows, 2F], a_w =
        w * f(h, u) rounded once, grad_w = sum_f g * f(h, u) in fp32) (moonep.datapath.reference.glu_route_backward)."""
        ...

    def scale_rows(self, o: torch.Tensor, w_rows: torch.Tensor, out: torch.Tensor) -> None:
        """out[r] = o[r] * w[r], the fp32 product rounded once to out's dtype."""
        ...
