"""Per MoE layer balance statistics, computed on device every step, read on the host only when logging.

Legend: L MoE layers, E experts, R EP ranks.

- expert maxvio (before balancing): max_e T_e / mean(T) - 1 over the world-reduced token counts of the
  step, i.e. what an unbalanced EP layout would see (docs/moonep.md §1);
- rank maxvio (after planning): the same over the rows each EP rank processes. moonep: from the plan's
  alloc_ER (rows of expert e processed on rank d), summed per rank: 0 by construction. Other backends:
  the tokens of each rank's home experts (no balancing);
- redundant experts: moonep's filled prefetch slots over all ranks (plan.slot_expert_RB >= 0);
- prefetch bytes: the expert weights this rank pulled into its slots (ExpertPools.prefetch_bytes).

moonep's plan of a layer is read through its public API: after a layer's forward, `pools.slot_plan` is
the plan that layer just prefetched for. A forward hook keeps it; activation checkpointing re-runs the
forward with the same inputs, so the kept plan is replaced by an identical one, never counted twice.
"""

from __future__ import annotations

import torch
from torch import nn

from moontrain.metrics.balance import maxvio_L
from moontrain.metrics.heatmap import ExpertLoad

FIELDS = ("expert_maxvio", "rank_maxvio", "redundant_experts", "prefetch_bytes")


class MoEStats:
    def __init__(self, moe_layers: list[nn.Module], *, ep: int) -> None:
        self.ep = ep
        self.moe_layers = moe_layers
        self.pools = [getattr(moe.backend, "pools", None) for moe in moe_layers]
        self.plans: list = [None] * len(moe_layers)
        self.load: ExpertLoad | None = None  # token counts summed over the steps since the last heatmap
        for i, (moe, pools) in enumerate(zip(moe_layers, self.pools, strict=True)):
            if pools is not None:
                moe.register_forward_hook(self._keeper(i, pools))

    def _keeper(self, i: int, pools):
        """The plan of layer i's last forward (with gradient accumulation: of the step's last pass)."""
        def keep(module: nn.Module, args, output) -> None:
            self.plans[i] = pools.slot_plan

        return keep

    @torch.no_grad()
    def step(self, counts_LE: torch.Tensor) -> torch.Tensor:
        """[4, L] float64 on device: FIELDS for every MoE layer of this step."""
        L = counts_LE.shape[0]
        if L == 0:
            return torch.zeros(len(FIELDS), 0, dtype=torch.float64, device=counts_LE.device)
        if self.load is None:
            self.load = ExpertLoad(L, counts_LE.shape[1], counts_LE.device)
        self.load.add(counts_LE)
        expert = maxvio_L(counts_LE).double()
        if all(p is not None for p in self.plans):
            rows_LR = torch.stack([plan.alloc_ER.sum(0) for plan in self.plans])
            redundant = torch.stack([(plan.slot_expert_RB >= 0).sum() for plan in self.plans]).double()
            prefetch = torch.stack([pools.prefetch_bytes(plan) for pools, plan in
                                    zip(self.pools, self.plans, strict=True)]).double()
        else:
            rows_LR = counts_LE.view(L, self.ep, -1).sum(-1)
            redundant = prefetch = torch.zeros(L, dtype=torch.float64, device=counts_LE.device)
        rank = maxvio_L(rows_LR).double()
        self.plans = [None] * len(self.plans)
        return torch.stack([expert, rank, redundant, prefetch])
