"""The Triton data path (CUDA): the kernels of moonep.kernels and the fused planner, bitwise equal to
moonep.datapath.reference (the specification) except where a docstring below says otherwise.

- plan: moonep.planner.fused (histogram counted from topk_sK on the device, exchanged by peer
  stores, planned in three more kernels; one CUDA graph replay per call).
- dispatch and combine: moonep.kernels.dispatch_combine (its docstring holds the protocol: a push
  combine through a landing region). Combine needs the receive rows' sources (row_src, and with
  combine_reduce "destination" the chain links row_chain) of its plan; when the plan is not the one
  of the last dispatch on this buffer, combine first rewrites them (barriers "combine:enter" /
  "combine:meta"; every rank takes this branch together, as every rank runs the same call sequence).
- prefetch / reduce_grad / the masked weight-gradient accumulation: moonep.kernels.experts (they
  touch occupied slots and non-empty groups only).
- the expert GEMMs: torch._grouped_mm, or with BufferOptions.fused_expert_gemm the fused kernels
  moonep.kernels.grouped_glu (gate|up and the activation) and .grouped_wgrad (the weight gradient into
  the fp32 grads), or with BufferOptions.expert_gemm="quack" quack's grouped GEMMs (moonep.kernels.quack_gemm,
  the weight gradient added in their epilogue; "quack_wgrad": that weight gradient only): other summation orders, within the bounds of
  tests/moonep/helpers/grouped_gemm_cases.py.
- the activation and the route weights: moonep.kernels.glu_rows (forward, on the halves of the merged gate|up
  GEMM's rows), moonep.kernels.glu_route
  (the backward with the route weights folded in) and moonep.kernels.route_weights (the forward scale; the
  route-weight gradient sums in another order than torch.sum: within a bound the tests derive;
  SiTU-GLU's device exp and division are approximate: within the bound of tests/moonep/helpers/situ_glu_cases.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moonep.activation import get_activation
from moonep.datapath.interface import CommViews
from moonep.grouped_gemm import grouped_mm, grouped_mm_wgrad
from moonep.kernels import (
    dispatch_combine,
    experts,
    glu_route,
    glu_rows,
    grouped_glu,
    grouped_wgrad,
    quack_gemm,
    route_weights,
)
from moonep.planner.fused import FusedPlanner
from moonep.planner.plan import Plan


class TritonPath:
    name = "triton"
    counts_topk = True

    def __init__(self, comm: CommViews) -> None:
        self.comm = comm
        opts = comm.options
        self._grid = opts.num_sms or torch.cuda.get_device_properties(comm.device).multi_processor_count
        self._scatter_work = dispatch_combine.scatter_work(comm.device)  # calls of a Buffer are stream-ordered
        self._planner = FusedPlanner(comm.layout, comm.rank, comm.every["hist"],
                                     lambda: comm.barrier("dispatch:histograms"))
        self._rows_plan: Plan | None = None  # plan of the last dispatch: its rows' sources are in row_src
        self.combine_reduce = opts.combine_reduce
        self._quack_rows = opts.expert_gemm == "quack"  # forward and input-gradient GEMMs
        self._quack_wgrad = opts.expert_gemm in ("quack", "quack_wgrad")
        self._reduce_first = self.combine_reduce == "destination"  # the chain links: written and read
        self._chain_scratch = (dispatch_combine.chain_scratch(comm.layout.nvs, comm.layout.config.topk, comm.device)
                               if self._reduce_first else None)  # the destination's resolved chains

    # ------------------------------------------------------------------ Buffer
    def plan(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None, total_num_tokens: int | None,
             check_counts: Callable[[torch.Tensor], None] | None) -> Plan:
        plan = self._planner(topk_sK, total_num_tokens)
        if check_counts is not None:
            check_counts(plan.counts_RE)
        return plan

    def scatter(self, plan: Plan, x_sH: torch.Tensor, weights_sK: torch.Tensor | None, *, rows: bool = True) -> None:
        c = self.comm
        every = c.every
        dispatch_combine.scatter(x_sH, weights_sK, plan.dst_rank_sK, plan.dst_row_sK, plan.copy_row_sK, plan.sent_sK,
                                 every["recv"], every["row_weight"], every["row_link"],
                                 every["row_chain"] if self._reduce_first else None,
                                 self._src_base(plan), c.rank, self._grid, self._scatter_work,
                                 tile=c.options.scatter_tile, rows=rows)

    def _src_base(self, plan: Plan) -> int:
        """row_src of this rank's entry (0, 0): its entry t * K + k has row_src src_base + t * K + k."""
        return self.comm.rank * self.comm.layout.config.max_tokens * plan.topk

    def expand(self, plan: Plan, *, copy: bool = True) -> None:
        c = self.comm
        mine = c.mine
        dispatch_combine.expand(mine["recv"], mine["row_weight"], mine["row_link"], plan.offs_RG[c.rank],
                                plan.group_rows_RG[c.rank], plan.nvs_s, c.layout.zero_row,
                                c.layout.config.token_padding, self._src_base(plan),
                                c.layout.config.max_tokens * plan.topk, copy=copy)
        self._rows_plan = plan

    def combine(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None,
                row_weights: torch.Tensor | None = None, add_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        c = self.comm
        mine, every, K = c.mine, c.every, plan.topk
        cfg = c.layout.config
        if plan is not self._rows_plan:
            c.barrier("combine:enter")
            self.scatter(plan, y_rows, None, rows=False)
            self.expand(plan, copy=False)
            c.barrier("combine:meta")
        first = self._reduce_first
        dispatch_combine.push(y_rows, row_scalars, mine["row_link"], plan.nvs_s, every["land"], every["land_scalar"],
                              cfg.max_tokens * K, self._grid, row_chain=mine["row_chain"] if first else None,
                              scratch=self._chain_scratch, row_weights=row_weights, add_rows=add_rows)
        c.barrier("combine:rows")
        s = plan.num_tokens
        y_sH = torch.empty(s, cfg.hidden, dtype=cfg.dtype, device=c.device)
        dispatch_combine.reduce(mine["land"], y_sH, K, plan.sent_sK if first else None)
        scalars_sK = mine["land_scalar"][: s * K].view(s, K).clone() if row_scalars is not None else None
        c.barrier("combine:done")
        return y_sH, scalars_sK

    def pooled_plans(self) -> int:
        return self._planner.pooled_plans()

    # ------------------------------------------------------------------ ExpertPools
    def prefetch(self, plan: Plan, w_full: torch.Tensor) -> None:
        experts.prefetch(w_full, plan.slot_expert_RB, plan.rank, plan.num_experts)

    def reduce_into_owner(self, plan: Plan, g_local: torch.Tensor, g_slots_all: torch.Tensor) -> None:
        experts.reduce_into_owner(g_local, g_slots_all, plan.slot_expert_RB, plan.rank)

    def zero_slots(self, plan: Plan, g_slots_all: torch.Tensor) -> None:
        experts.zero_slots(g_slots_all, plan.slot_expert_RB, plan.rank)

    def accumulate_wgrad(self, g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor,
                         offs_G: torch.Tensor, scale: float, write_groups: int) -> None:
        if self.comm.options.fused_expert_gemm:
            grouped_wgrad.grouped_wgrad_accumulate(g_GIO, x_rows, grad_rows, offs_G, scale, write_groups)
            return
        if self._quack_wgrad:
            quack_gemm.accumulate_wgrad(g_GIO, x_rows, grad_rows, offs_G, scale, write_groups)
            return
        experts.accumulate_groups(g_GIO, grouped_mm_wgrad(x_rows, grad_rows, offs_G), offs_G, scale,
                                  write_groups=write_groups)

    # ------------------------------------------------------------------ expert math
    def grouped_mm(self, x_rows: torch.Tensor, w_GIO: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        return quack_gemm.grouped_mm(x_rows, w_GIO, offs_G) if self._quack_rows else grouped_mm(x_rows, w_GIO, offs_G)

    def gate_up(self, activation: str, x_rows: torch.Tensor, w_gate_up: torch.Tensor, offs_G: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.comm.options.fused_expert_gemm:
            return grouped_glu.grouped_glu_forward(x_rows, w_gate_up, offs_G, activation)
        hu = self.grouped_mm(x_rows, w_gate_up, offs_G)
        return self.glu_forward(activation, hu), hu

    def glu_forward(self, activation: str, hu: torch.Tensor) -> torch.Tensor:
        get_activation(activation)  # a ValueError for names moonep does not know
        return glu_rows.glu_forward_rows(activation, hu)

    def glu_route_backward(self, activation: str, g: torch.Tensor, hu: torch.Tensor, w_rows: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return glu_route.glu_route_backward_rows(activation, g, hu, w_rows)

    def scale_rows(self, o: torch.Tensor, w_rows: torch.Tensor, out: torch.Tensor) -> None:
        route_weights.scale_rows(o, w_rows, out)

