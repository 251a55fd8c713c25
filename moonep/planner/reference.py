"""The online planner (docs/moonep.md §5), pure PyTorch: the executable specification.

Every rank runs this on the gathered histograms and gets the same shared plan (caps, quotas,
per-expert allocation, slots, group offsets); it also computes where its own (token, k) entries
go. The code is device-agnostic and free of host synchronisation: the greedy loops run a fixed
number of masked iterations (R - 1 for receiver filling, epn + R - 1 for the quota split) instead
of data-dependent `.item()` checks, so the same function runs on CUDA tensors without a sync.
GPU kernels must produce identical integer outputs.

Entries mode (BufferConfig.entries, the host stage of moonep.hierarchical): expert id -1 marks an absent
entry; the histograms count only present entries, the caps split their total (entry_caps), and an absent
entry gets no destination (this rank's trash row, not sent, outside every token's dedup).

Legend: R ranks, E experts, epn = E / R, B slots per rank, G = E + B groups (rows of W_full),
s tokens of this rank, K top-k.
"""

from __future__ import annotations

import torch

from moonep.layout import Layout
from moonep.planner.plan import Plan
from moonep.validate import (
    ENTRIES_TOTAL,
    check_counts,
    check_gathered_counts,
    check_num_tokens,
    check_routing_values,
    check_tensor,
)

_I64 = torch.int64


def receive_caps(num_ranks: int, topk: int, *, num_tokens: int | None, total_num_tokens: int | None,
                 device: torch.device) -> torch.Tensor:
    """§5.1: cap_d = s*K for a common s; with per-rank s (total T), T*K split as evenly as
    possible with the remainder to the lowest ranks."""
    if total_num_tokens is None:
        assert num_tokens is not None
        return torch.full((num_ranks,), num_tokens * topk, dtype=_I64, device=device)
    total = total_num_tokens * topk
    base, rem = divmod(total, num_ranks)
    return base + (torch.arange(num_ranks, device=device) < rem).to(_I64)


def entry_caps(counts_RE: torch.Tensor) -> torch.Tensor:
    """§5.1 in entries mode (BufferConfig.entries): the group's T entries (the gathered histograms'
    sum) split as evenly as possible, the remainder to the lowest ranks; on the device, no host sync."""
    R = counts_RE.shape[0]
    total = counts_RE.to(_I64).sum()
    return total // R + (torch.arange(R, device=counts_RE.device) < total % R).to(_I64)


def fill_receivers(group_R: torch.Tensor, cap_R: torch.Tensor) -> torch.Tensor:
    """§5.2: quota z[h, u]. Each step the most loaded home group h (lowest index on ties) fills
    the emptiest receiver u completely; a filled receiver is never picked again, so every rank
    receives from at most one remote home group. Each step fills one rank for good, so R - 1
    masked steps always suffice."""
    R = group_R.numel()
    balance = group_R.to(_I64) - cap_R
    quota = torch.zeros(R, R, dtype=_I64, device=group_R.device)
    for _ in range(R - 1):
        # 1-element index tensors: indexing with a 0-dim tensor would read it on the host
        h = torch.argmax(balance).view(1)
        u = torch.argmin(balance).view(1)
        bal_h, bal_u = balance[h], balance[u]
        active = bal_h > 0
        zero = torch.zeros_like(bal_u)
        quota.index_put_((h, u), torch.where(active, -bal_u, zero), accumulate=True)
        new_h = bal_h + torch.where(active, bal_u, zero)
        new_u = torch.where(active, zero, bal_u)
        balance = balance.index_put((u,), new_u).index_put((h,), new_h)
    return quota


def split_quota(count_E: torch.Tensor, quota_RR: torch.Tensor) -> torch.Tensor:
    """§5.3: alloc[e, d]. For every donor h in parallel: the largest open quota (lowest
    receiver on ties) takes from h's expert with the most remaining tokens (lowest id on ties).
    Each step closes a quota or empties an expert, so epn + R - 1 masked steps suffice."""
    R = quota_RR.shape[0]
    E = count_E.numel()
    epn = E // R
    device = count_E.device
    remaining = count_E.to(_I64).view(R, epn).clone()
    quota = quota_RR.clone()
    alloc = torch.zeros(E, R, dtype=_I64, device=device)
    home_base = torch.arange(R, device=device) * epn
    for _ in range(epn + R - 1):
        d = torch.argmax(quota, dim=1)  # [R] receiver per donor
        q = quota.gather(1, d[:, None]).squeeze(1)
        le = torch.argmax(remaining, dim=1)  # [R] local expert per donor
        rem = remaining.gather(1, le[:, None]).squeeze(1)
        take = torch.minimum(q, rem)  # 0 for donors that are done
        quota.scatter_add_(1, d[:, None], -take[:, None])
        remaining.scatter_add_(1, le[:, None], -take[:, None])
        alloc.index_put_((home_base + le, d), take, accumulate=True)
    alloc.view(R, epn, R)[torch.arange(R, device=device), :, torch.arange(R, device=device)] += remaining
    return alloc


def assign_slots(alloc_ER: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§5.4: remote experts with tokens on rank d take its slots in ascending expert id.

    Returns (slot_expert_RB, group_ER): the expert in each slot (-1 empty) and the W_full row each
    expert's tokens use on each rank (its home row when local or when slots ran out, E + j for
    slot j)."""
    E, R = alloc_ER.shape
    epn = E // R
    device = alloc_ER.device
    e_idx = torch.arange(E, device=device)
    home_E = e_idx // epn
    remote = (alloc_ER > 0) & (home_E[:, None] != torch.arange(R, device=device)[None, :])
    slot_ER = torch.cumsum(remote.to(_I64), dim=0) - 1
    in_slot = remote & (slot_ER < num_slots)
    group_ER = torch.where(in_slot, E + slot_ER, e_idx[:, None].expand(E, R))
    # scatter expert ids into [R, B + 1]; column B is a dump for experts without a slot
    slot_col = torch.where(in_slot, slot_ER, torch.full_like(slot_ER, num_slots))
    slots = torch.full((R, num_slots + 1), -1, dtype=_I64, device=device)
    rows = torch.arange(R, device=device)[None, :].expand(E, R)
    expert_or_none = torch.where(in_slot, e_idx[:, None].expand(E, R), -1)
    slots.index_put_((rows.reshape(-1), slot_col.reshape(-1)), expert_or_none.reshape(-1))
    return slots[:, :num_slots].to(torch.int32), group_ER


def group_offsets(alloc_ER: torch.Tensor, group_ER: torch.Tensor, num_slots: int,
                  token_padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§5.4: rows per W_full row on each rank, and cumulative padded ends (offs)."""
    E, R = alloc_ER.shape
    G = E + num_slots
    rows = torch.zeros(R, G, dtype=_I64, device=alloc_ER.device)
    rows.scatter_add_(1, group_ER.t().contiguous(), alloc_ER.t().to(_I64).contiguous())
    padded = (rows + token_padding - 1) // token_padding * token_padding
    return rows.to(torch.int32), torch.cumsum(padded, dim=1).to(torch.int32)


def token_destinations(topk_sK: torch.Tensor, counts_RE: torch.Tensor, rank: int, alloc_ER: torch.Tensor,
                       group_ER: torch.Tensor, group_rows_RG: torch.Tensor, offs_RG: torch.Tensor,
                       token_padding: int, absent_row: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """§5.5: (dst_rank, dst_row, copy_row, sent) for each of this rank's entries.

    Within an expert, entries are ordered by (source rank, flat index t*K + k); the first
    alloc[e, 0] go to rank 0, the next alloc[e, 1] to rank 1, and so on. A token whose entries
    share a destination rank is sent once (its lowest k) and copied locally on arrival. An absent
    entry (expert id -1, entries mode) goes nowhere: (this rank, `absent_row`), copy_row `absent_row`,
    not sent; it never takes part in a token's dedup."""
    s, K = topk_sK.shape
    device = topk_sK.device
    E = counts_RE.shape[1]
    expert = topk_sK.reshape(-1).to(_I64)  # [sK]
    valid = expert >= 0
    key = torch.where(valid, expert, E)  # absent entries sort after every expert
    e_safe = torch.where(valid, expert, 0)
    order = torch.sort(key, stable=True).indices
    local_counts = counts_RE[rank].to(_I64)
    local_start = torch.cumsum(local_counts, 0) - local_counts
    local_start = torch.cat([local_start, local_counts.sum().view(1)])  # [E + 1]: absent entries last
    rank_in_expert = torch.empty_like(expert)
    rank_in_expert[order] = torch.arange(s * K, device=device) - local_start[key[order]]
    before_me = torch.cumsum(counts_RE.to(_I64), 0)[rank] - counts_RE[rank].to(_I64)  # [E]
    pos = before_me[e_safe] + rank_in_expert  # position in expert's global entry list
    alloc_end = torch.cumsum(alloc_ER.to(_I64), 1)  # [E, R]
    dst_rank = (alloc_end[e_safe] <= pos[:, None]).sum(1)  # first d with pos < end
    dst_rank = torch.where(valid, dst_rank, rank)
    chunk_start = alloc_end[e_safe, dst_rank] - alloc_ER[e_safe, dst_rank].to(_I64)
    group = group_ER[e_safe, dst_rank]
    padded_RG = (group_rows_RG.to(_I64) + token_padding - 1) // token_padding * token_padding
    group_start = offs_RG.to(_I64)[dst_rank, group] - padded_RG[dst_rank, group]
    dst_row = torch.where(valid, group_start + pos - chunk_start, absent_row)
    # dedup: the first k of a token going to a given rank carries the row
    valid_sK = valid.view(s, K)
    dst_rank_sK = dst_rank.view(s, K)
    dst_row_sK = dst_row.view(s, K)
    same = (dst_rank_sK[:, :, None] == dst_rank_sK[:, None, :]) & valid_sK[:, :, None] & valid_sK[:, None, :]
    first_k = torch.argmax(same.to(torch.int8), dim=2)  # lowest k' with the same rank
    sent = (first_k == torch.arange(K, device=device)[None, :]) & valid_sK
    copy_row = torch.where(valid_sK, torch.gather(dst_row_sK, 1, first_k), absent_row)
    return dst_rank_sK.to(torch.int32), dst_row_sK.to(torch.int32), copy_row.to(torch.int32), sent


def plan_shared(counts_RE: torch.Tensor, cap_R: torch.Tensor, num_slots: int, token_padding: int
                ) -> tuple[torch.Tensor, ...]:
    """§5.2-§5.4, the part every rank computes identically: (quota_RR, alloc_ER, slot_expert_RB,
    group_ER, group_rows_RG, offs_RG)."""
    R = cap_R.numel()
    count_E = counts_RE.to(_I64).sum(0)
    group_R = count_E.view(R, -1).sum(1)
    quota = fill_receivers(group_R, cap_R)
    alloc = split_quota(count_E, quota)
    slot_expert, group_ER = assign_slots(alloc, num_slots)
    group_rows, offs = group_offsets(alloc, group_ER, num_slots, token_padding)
    return quota, alloc.to(torch.int32), slot_expert, group_ER, group_rows, offs


def build_plan(layout: Layout, rank: int, topk_sK: torch.Tensor, counts_RE: torch.Tensor,
               total_num_tokens: int | None = None) -> Plan:
    """make_plan without its checks: no host synchronisation, for inputs a Buffer has validated."""
    R, B, K = layout.num_ranks, layout.num_slots, layout.config.topk
    pad = layout.config.token_padding
    s = topk_sK.shape[0]
    device = topk_sK.device
    if layout.config.entries:
        cap_R = entry_caps(counts_RE)
    else:
        cap_R = receive_caps(R, K, num_tokens=s, total_num_tokens=total_num_tokens, device=device)
    quota, alloc, slot_expert, group_ER, group_rows, offs = plan_shared(counts_RE, cap_R, B, pad)
    dst_rank, dst_row, copy_row, sent = token_destinations(topk_sK, counts_RE, rank, alloc, group_ER,
                                                           group_rows, offs, pad, layout.trash_row)
    return Plan(
        rank=rank, num_ranks=R, num_experts=layout.config.num_experts, num_slots=B, topk=K, num_tokens=s,
        nvs_s=layout.call_rows(s, total_num_tokens), counts_RE=counts_RE.to(torch.int32), cap_R=cap_R, quota_RR=quota,
        alloc_ER=alloc, slot_expert_RB=slot_expert, group_rows_RG=group_rows, offs_RG=offs,
        dst_rank_sK=dst_rank, dst_row_sK=dst_row, copy_row_sK=copy_row, sent_sK=sent,
    )


def make_plan(layout: Layout, rank: int, topk_sK: torch.Tensor, counts_RE: torch.Tensor, *,
              total_num_tokens: int | None = None) -> Plan:
    """Plan one dispatch from this rank's routing and every rank's histogram (§5), as every
    planner of a Buffer does, with the checks of Buffer.plan (§8: ValueError naming the value;
    host synchronisations)."""
    R, S = layout.num_ranks, layout.config.max_tokens
    if not 0 <= rank < R:
        raise ValueError(f"rank={rank} is outside [0, {R}) for a layout of R={R} ranks")
    s = topk_sK.shape[0] if isinstance(topk_sK, torch.Tensor) and topk_sK.dim() == 2 else -1
    check_num_tokens(layout, s)
    check_tensor("topk_sK", topk_sK, shape=(s, layout.config.topk), dtype=(torch.int32, torch.int64),
                 device=topk_sK.device)
    check_tensor("counts_RE", counts_RE, shape=(R, layout.config.num_experts), dtype=(torch.int32, torch.int64),
                 device=topk_sK.device)
    if total_num_tokens is not None and not s <= total_num_tokens <= R * S:
        raise ValueError(f"total_num_tokens={total_num_tokens} must lie in [{s}, R*S={R * S}]")
    if total_num_tokens is not None and layout.config.entries:
        raise ValueError(ENTRIES_TOTAL)
    check_counts(layout, counts_RE)
    check_routing_values(layout, topk_sK, counts_RE[rank])
    check_gathered_counts(layout, counts_RE, s, total_num_tokens)
    return build_plan(layout, rank, topk_sK, counts_RE, total_num_tokens)
