"""The pure-PyTorch data path: the specification of every moonep kernel (docs/moonep.md §5, §6).

Runs on any device (the CPU heap in tests, CUDA as the GPU tests' reference), never synchronises with
the host, and is written for clarity: index_put_ over the all-ranks views to send, index_select to
expand, advanced indexing to pull combine's rows. Sync-free, it cannot know which slots are occupied:
prefetch copies all B slots (empty ones onto themselves), reduce_grad reads every peer slot, masked.

Protocol of the calls (the barriers come from the Buffer, `CommViews.barrier`):
plan
    1. write tokens_per_expert into row `rank` of every peer's hist region (unicast)
    2. barrier "dispatch:histograms"
    3. every rank plans redundantly from the gathered [R, E] histograms (moonep.planner.reference)
dispatch
    4. scatter: for every (t, k): route weight, copy row and source id into the destination's row
       metadata; the token row itself once per (token, destination rank); the receiver marks its
       own padding rows (copy from the zero row, weight 0, no source)
    5. barrier "dispatch:rows" (Buffer)
    6. expand: the receiver expands duplicates and zeroes padding: row <- row[copy_row]
combine
    1. y rows land in the comb region (no copy when the caller wrote into Buffer.combine_input)
    2. barrier "combine:rows"
    3. each source pulls its K rows per token from the destinations and sums them in fp32 in
       ascending k; optional per-row scalars (route-weight grads) likewise; an absent entry (entries
       mode, BufferConfig.entries) points at the trash row and adds zero (its scalar is 0)
    4. barrier "combine:done" so the comb region may be rewritten
combine, BufferOptions.combine_reduce "destination" (push-style, through the land region)
    0. when `plan` is not the last dispatch's: barrier "combine:enter", row_src rewritten for
       `plan`, barrier "combine:meta" (as the triton path)
    1. each destination sums, per (source rank, token), the fp32 values of the token's rows it
       holds in ascending k (the first taken as is, then one add per row), rounds once and writes
       that row into the source's landing row of the first of those entries; every row's scalar
       into its entry's slot
    2. barrier "combine:rows"
    3. each source sums its partial rows (the entries with sent_sK) in fp32 in ascending k, one
       rounding; an absent entry has no row and a scalar 0
    4. barrier "combine:done"

Legend: s tokens, K top-k, H hidden, E experts, R ranks, B slots, epn = E / R, nvs_s rows of this
call, I/O an expert matrix's in/out features, G groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moonep.activation import get_activation
from moonep.datapath.interface import CommViews
from moonep.grouped_gemm import accumulate_wgrad, grouped_mm
from moonep.planner.plan import Plan
from moonep.planner.reference import build_plan

# prefetch and reduce_grad gather whole slots; at K3 sizes all B slots at once would need tens of GB
_TEMP_BYTES = 1 << 30


def _slot_chunks(num_slots: int, slot: torch.Tensor) -> list[tuple[int, int]]:
    """Slot ranges whose temporaries (slots shaped like `slot`) stay under _TEMP_BYTES."""
    step = max(1, _TEMP_BYTES // (slot.numel() * slot.element_size()))
    return [(j, min(j + step, num_slots)) for j in range(0, num_slots, step)]


class ReferencePath:
    name = "torch"
    counts_topk = False

    def __init__(self, comm: CommViews) -> None:
        self.comm = comm
        self.combine_reduce = comm.options.combine_reduce
        self._rows_plan: Plan | None = None  # plan of the last dispatch: its rows' sources are in row_src

    # ------------------------------------------------------------------ Buffer
    def plan(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None, total_num_tokens: int | None,
             check_counts: Callable[[torch.Tensor], None] | None) -> Plan:
        c = self.comm
        c.every["hist"][:, c.rank, :] = tokens_per_expert_E.to(torch.int32)
        c.barrier("dispatch:histograms")
        counts_RE = c.mine["hist"].clone()
        if check_counts is not None:
            check_counts(counts_RE)
        return build_plan(c.layout, c.rank, topk_sK, counts_RE, total_num_tokens)

    def scatter(self, plan: Plan, x_sH: torch.Tensor, weights_sK: torch.Tensor | None) -> None:
        c = self.comm
        mine, every, layout = c.mine, c.every, c.layout
        s, K = plan.num_tokens, plan.topk
        dst_rank = plan.dst_rank_sK.reshape(-1).long()
        dst_row = plan.dst_row_sK.reshape(-1).long()
        # this rank as receiver: padding rows copy from the zero row, weight 0, no source
        pad = ~self._valid_rows(plan)
        mine["row_copy"][: plan.nvs_s].masked_fill_(pad, layout.zero_row)
        mine["row_weight"][: plan.nvs_s].masked_fill_(pad, 0.0)
        # this rank as sender: metadata for every entry, the row once per (token, rank)
        idx = (dst_rank, dst_row)
        every["row_copy"].index_put_(idx, plan.copy_row_sK.reshape(-1))
        self._write_sources(plan, pad)
        if weights_sK is not None:
            every["row_weight"].index_put_(idx, weights_sK.reshape(-1).float())
        sent = plan.sent_sK.reshape(-1)
        rows_to = (torch.where(sent, dst_rank, c.rank), torch.where(sent, dst_row, layout.trash_row))
        token = torch.arange(s * K, device=c.device) // K
        every["recv"].index_put_(rows_to, x_sH.index_select(0, token))

    def _write_sources(self, plan: Plan, pad: torch.Tensor) -> None:
        """row_src: -1 on this rank's padding rows, each entry's source id on its destination row."""
        c = self.comm
        K = plan.topk
        c.mine["row_src"][: plan.nvs_s].masked_fill_(pad, -1)
        idx = (plan.dst_rank_sK.reshape(-1).long(), plan.dst_row_sK.reshape(-1).long())
        flat = torch.arange(plan.num_tokens * K, device=c.device, dtype=torch.int32)
        c.every["row_src"].index_put_(idx, c.rank * c.layout.config.max_tokens * K + flat)

    def _valid_rows(self, plan: Plan) -> torch.Tensor:
        """[nvs_s] bool: rows of this rank that receive a token (not padding)."""
        c = self.comm
        offs = plan.offs_RG[c.rank].long()
        sizes = plan.group_rows_RG[c.rank].long()
        pad = c.layout.config.token_padding
        padded = (sizes + pad - 1) // pad * pad
        row = torch.arange(plan.nvs_s, device=c.device)
        g = torch.searchsorted(offs, row, right=True).clamp(max=offs.numel() - 1)
        return (row < offs[-1]) & (row - (offs[g] - padded[g]) < sizes[g])

    def expand(self, plan: Plan) -> None:
        recv = self.comm.mine["recv"]
        recv[: plan.nvs_s].copy_(recv.index_select(0, self.comm.mine["row_copy"][: plan.nvs_s].long()))
        self._rows_plan = plan

    def combine(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None,
                row_weights: torch.Tensor | None = None, add_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.combine_reduce == "destination":
            return self._combine_destination(plan, y_rows, row_scalars, row_weights, add_rows)
        c = self.comm
        comb = c.mine["comb"][: plan.nvs_s]
        if row_weights is not None or add_rows is not None:  # the fp32 value, rounded once per row
            comb.copy_(row_values(y_rows, row_weights, add_rows))
        elif y_rows.data_ptr() != comb.data_ptr():
            comb.copy_(y_rows)
        if row_scalars is not None:
            c.mine["row_scalar"][: plan.nvs_s].copy_(row_scalars)
        c.barrier("combine:rows")
        idx = (plan.dst_rank_sK.long(), plan.dst_row_sK.long())
        rows_sKH = c.every["comb"][idx]
        scalars_sK = c.every["row_scalar"][idx].clone() if row_scalars is not None else None
        if c.layout.config.entries:  # absent entries point at the trash row: they add zero
            present_sK = plan.dst_row_sK != c.layout.trash_row
            rows_sKH = torch.where(present_sK[:, :, None], rows_sKH, 0)
            if scalars_sK is not None:
                scalars_sK = torch.where(present_sK, scalars_sK, 0.0)
        y_sH = rows_sKH[:, 0].float()
        for k in range(1, plan.topk):
            y_sH += rows_sKH[:, k].float()
        c.barrier("combine:done")
        return y_sH.to(c.layout.config.dtype), scalars_sK

    def _combine_destination(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None,
                             row_weights: torch.Tensor | None, add_rows: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """combine_reduce "destination" (BufferOptions): push-style, through the landing rows.

        Destination: for every (source rank, token) with rows here, the rows' fp32 values
        (row_values) summed in ascending k (the first taken as is, then one add per row), rounded
        once to the dtype, into the source's landing row of the first of those entries; every row's
        scalar into its entry's slot. Source: y[t] = the fp32 sum of its partial rows (the landing
        rows of entries with sent_sK) in ascending k, one rounding. The rows of a token are found
        through a [R*S, K] table of row indices keyed by row_src (no host sync)."""
        c = self.comm
        cfg, K, n = c.layout.config, plan.topk, plan.nvs_s
        SK = cfg.max_tokens * K
        if plan is not self._rows_plan:  # row_src describes another plan's rows: rewrite it (the triton path's order)
            c.barrier("combine:enter")
            self._write_sources(plan, ~self._valid_rows(plan))
            c.barrier("combine:meta")
        # destination side
        src = c.mine["row_src"][:n].long()
        valid = src >= 0
        table_rows = plan.num_ranks * cfg.max_tokens + 1  # one per (source rank, token slot), one trash row
        token = torch.where(valid, src // K, table_rows - 1)
        k_r = src % K
        table = torch.full((table_rows, K), -1, dtype=torch.long, device=c.device)
        row = torch.arange(n, device=c.device)
        table.index_put_((token, torch.where(valid, k_r, 0)), torch.where(valid, row, -1))
        table[-1] = -1  # invalid rows wrote there
        mine_sK = table[token]  # [n, K]: the rows of each row's token here, by k
        earlier = (mine_sK >= 0) & (torch.arange(K, device=c.device)[None, :] < k_r[:, None])
        first = valid & ~earlier.any(1)  # the row of the token's first entry here: it carries the sum
        vals = row_values(y_rows, row_weights, add_rows)
        acc = vals.clone()
        for k in range(K):
            later = first & (k > k_r) & (mine_sK[:, k] >= 0)
            acc = torch.where(later[:, None], acc + vals[mine_sK[:, k].clamp(min=0)], acc)
        rank_to = torch.where(first, src // SK, c.rank)
        entry_to = torch.where(first, src % SK, SK)  # SK: the landing trash row
        c.every["land"].index_put_((rank_to, entry_to), acc.to(cfg.dtype))
        if row_scalars is not None:
            c.every["land_scalar"].index_put_((torch.where(valid, src // SK, c.rank), torch.where(valid, src % SK, SK)),
                                              row_scalars)
        c.barrier("combine:rows")
        # source side
        s = plan.num_tokens
        land_sKH = c.mine["land"][: s * K].view(s, K, cfg.hidden)
        y_sH = torch.zeros(s, cfg.hidden, dtype=torch.float32, device=c.device)
        have = torch.zeros(s, dtype=torch.bool, device=c.device)
        for k in range(K):
            p = plan.sent_sK[:, k]
            term = land_sKH[:, k].float()
            y_sH = torch.where((p & have)[:, None], y_sH + term, torch.where(p[:, None], term, y_sH))
            have |= p
        scalars_sK = None
        if row_scalars is not None:
            scalars_sK = c.mine["land_scalar"][: s * K].view(s, K).clone()
            if cfg.entries:  # an absent entry has no row anywhere: its scalar is 0
                scalars_sK = torch.where(plan.dst_row_sK != c.layout.trash_row, scalars_sK, 0.0)
        c.barrier("combine:done")
        return y_sH.to(cfg.dtype), scalars_sK

    def pooled_plans(self) -> int:
        return 0

    # ------------------------------------------------------------------ ExpertPools
    def prefetch(self, plan: Plan, w_full: torch.Tensor) -> None:
        E, B = plan.num_experts, plan.num_slots
        slot_e = plan.slot_expert_RB[plan.rank].long()
        src = torch.where(slot_e >= 0, slot_e, E + torch.arange(B, device=slot_e.device))
        for j0, j1 in _slot_chunks(B, w_full[0]):
            w_full[E + j0 : E + j1].copy_(w_full.index_select(0, src[j0:j1]))

    def reduce_into_owner(self, plan: Plan, g_local: torch.Tensor, g_slots_all: torch.Tensor) -> None:
        rank, R, epn, B = plan.rank, plan.num_ranks, plan.epn, plan.num_slots
        slot_e = plan.slot_expert_RB.long()  # [R, B]
        owned = (slot_e >= 0) & (slot_e // epn == rank)
        local_idx = torch.where(owned, slot_e - rank * epn, 0)
        for d in range(R):
            if d == rank:
                continue  # a rank never holds copies of its own experts
            for j0, j1 in _slot_chunks(B, g_local[0]):
                contrib = torch.where(owned[d, j0:j1, None, None], g_slots_all[d, j0:j1], 0.0)
                g_local.index_add_(0, local_idx[d, j0:j1], contrib)

    def zero_slots(self, plan: Plan, g_slots_all: torch.Tensor) -> None:
        g_slots_all[plan.rank].zero_()

    def accumulate_wgrad(self, g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor,
                         offs_G: torch.Tensor, scale: float, write_groups: int) -> None:
        if write_groups:
            g_GIO[:write_groups].zero_()
        accumulate_wgrad(g_GIO, x_rows, grad_rows, offs_G, scale)

    # ------------------------------------------------------------------ expert math
    def grouped_mm(self, x_rows: torch.Tensor, w_GIO: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x_rows, w_GIO, offs_G)

    def gate_up(self, activation: str, x_rows: torch.Tensor, w_gate_up: torch.Tensor, offs_G: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hu = self.grouped_mm(x_rows, w_gate_up, offs_G)
        return self.glu_forward(activation, hu), hu

    def glu_forward(self, activation: str, hu: torch.Tensor) -> torch.Tensor:
        h, u = hu.chunk(2, dim=-1)
        return get_activation(activation).forward(h, u)

    def glu_route_backward(self, activation: str, g: torch.Tensor, hu: torch.Tensor, w_rows: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, u = hu.chunk(2, dim=-1)
        grad_h, grad_u, a_w, grad_w = glu_route_backward(activation, g, h, u, w_rows)
        return torch.cat([grad_h, grad_u], dim=-1), a_w, grad_w

    def scale_rows(self, o: torch.Tensor, w_rows: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(o, w_rows[:, None], out=out)  # fp32 product, rounded once into out


def row_values(y_rows: torch.Tensor, row_weights: torch.Tensor | None, add_rows: torch.Tensor | None
               ) -> torch.Tensor:
    """The fp32 value combine sums for each row: y (+ add_rows) (* row_weights), one fp32 operation
    per step (the specification of the push kernel's row values)."""
    v = y_rows.float()
    if add_rows is not None:
        v = v + add_rows.float()
    if row_weights is not None:
        v = v * row_weights[:, None]
    return v


def glu_route_backward(activation: str, g: torch.Tensor, h: torch.Tensor, u: torch.Tensor, w_rows: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_glu's elementwise backward with the route weights folded in, for y_rows = w * (a W_down),
    a = f(h, u): from g = gy W_down^T (no weight applied) -> (grad_h, grad_u, a_w, grad_w) with
    grad_a = w * g in fp32 (the activation's backward rounds grad_h and grad_u once), a_w = w * a rounded
    once (dW_down = a_w^T gy) and grad_w = sum_f g * a in fp32 (= sum_h gy * o, without o). The
    specification of moonep.kernels.glu_route."""
    grad_h, grad_u, a = get_activation(activation).backward(g.float() * w_rows[:, None], h, u)
    grad_w = (g.float() * a.float()).sum(-1)
    a_w = torch.mul(a, w_rows[:, None], out=torch.empty_like(a))
    return grad_h, grad_u, a_w, grad_w
