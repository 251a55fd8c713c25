"""Plan: everything one dispatch, its combine, both backward passes, prefetch and reduce_grad need.

Every planner (the PyTorch specification in moonep.planner.reference, the fused Triton planner in
moonep.planner.fused) produces this object, bitwise equal on every field.

Legend: R ranks, E experts, epn = E / R, B slots per rank, G = E + B groups (rows of W_full),
s tokens of this rank, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything dispatch, prefetch, combine, both backward passes and reduce_grad need.

    Shared fields are identical on every rank; local fields describe this rank's tokens.
    """

    # static
    rank: int
    num_ranks: int
    num_experts: int
    num_slots: int
    topk: int
    num_tokens: int  # s of this rank
    nvs_s: int  # rows of the receive buffer this call may fill
    # shared (identical on every rank)
    counts_RE: torch.Tensor  # int32 tokens of expert e on source rank r
    cap_R: torch.Tensor  # int64 token slots each rank receives
    quota_RR: torch.Tensor  # int64 z[h, u]: tokens of home group h processed on receiver u
    alloc_ER: torch.Tensor  # int32 tokens of expert e processed on rank d
    slot_expert_RB: torch.Tensor  # int32 expert in slot j of rank d, -1 when empty
    group_rows_RG: torch.Tensor  # int32 token rows of W_full row g on rank d (unpadded)
    offs_RG: torch.Tensor  # int32 cumulative padded ends over W_full rows (cu_seqlens_full)
    # local (this rank's entries)
    dst_rank_sK: torch.Tensor  # int32 rank that processes entry (t, k)
    dst_row_sK: torch.Tensor  # int32 row of entry (t, k) in that rank's receive buffer
    copy_row_sK: torch.Tensor  # int32 row on dst that entry (t, k) is copied from (itself if sent)
    sent_sK: torch.Tensor  # bool entry carries the token row (first k of the token to that rank)

    @property
    def epn(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def cu_seqlens_full(self) -> torch.Tensor:
        """int32 [E + B]: offs over W_full rows for this rank (the torch._grouped_mm format)."""
        return self.offs_RG[self.rank]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [epn + B]: offs over W_compact (local experts, then slots), used in training
        where every remote expert has a slot (B = epn). The last rank's local rows end where the
        slots start (one rank: always), so its offs are a view of offs_RG, no copy."""
        lo = self.rank * self.epn
        if lo + self.epn == self.num_experts:
            return self.offs_RG[self.rank, lo:]
        return torch.cat([self.offs_RG[self.rank, lo : lo + self.epn], self.offs_RG[self.rank, self.num_experts :]])

    def shared(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _SHARED}

    def __repr__(self) -> str:
        head = (f"Plan(rank={self.rank}/{self.num_ranks}, E={self.num_experts}, B={self.num_slots}, "
                f"K={self.topk}, s={self.num_tokens}, nvs_s={self.nvs_s}")
        body = ",\n  ".join(f"{n}={getattr(self, n).tolist()}" for n in ("cap_R", "slot_expert_RB"))
        return f"{head},\n  {body})"


_SHARED = ("counts_RE", "cap_R", "quota_RR", "alloc_ER", "slot_expert_RB", "group_rows_RG", "offs_RG")
