"""Buffer: moonep's public EP communication object (pure-PyTorch data path, SPEC section 6).

Protocol of one call (every rank runs the same sequence of calls; every barrier names its call):

dispatch (fresh plan)
    1. write tokens_per_expert into row `rank` of every peer's hist region (unicast)
    2. barrier "dispatch:histograms"
    3. every rank plans redundantly from the gathered [R, E] histograms
    4. write, for every (t, k): route weight, copy row and source id into the destination's row
       metadata; the token row itself once per (token, destination rank); the receiver marks its
       own padding rows (copy from the zero row)
    5. barrier "dispatch:rows"
    6. the receiver expands duplicates and zeroes padding: row <- row[copy_row]
dispatch (saved plan): barrier "dispatch:enter" replaces 1-3, so no peer writes rows this rank
    may still be reading.
plan() alone is steps 1-3; a second plan() with no other call in between first passes barrier
    "plan:enter", so no peer overwrites histograms this rank has not read yet.
combine
    1. y rows (route weights already applied by the caller) land in the comb region (no copy when
       the caller wrote into `combine_input(plan)`)
    2. barrier "combine:rows"
    3. each source pulls its K rows per token from the destinations and sums them in fp32 in
       ascending k order (deterministic); optional per-row scalars (route-weight grads) likewise
    4. barrier "combine:done" so the comb region may be rewritten

With BufferConfig.kernels resolving to "triton" (CUDA), steps 1-3 of dispatch (plan()) run as the
kernels of moonep.kernels.plan_fused around the same barrier (the histogram counted from topk_sK on
the device, one CUDA graph replay per call), and steps 4-6 of dispatch and the whole combine as the
kernels of moonep.kernels.dispatch_combine (its docstring holds their protocol: a push combine
through a landing region). Both are bitwise equal to the path above.

dispatch_async / combine_async / reduce_grad_async queue the same calls on the buffer's communication
stream and return a CommEvent to wait on (moonep.comm_stream: ordering and memory rules).

Returned rows are zero-copy views into symmetric memory, valid until the next call on this buffer;
clone what must outlive it (autograd saves). No call synchronises with the host unless
`BufferConfig.check_values` is on.

Legend: s tokens of this rank, K top-k, H hidden, E experts, R ranks, nvs_s rows of this call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from moonep.comm_stream import CommEvent, CommStream
from moonep.config import BufferConfig
from moonep.heap import Piece, SymmetricHeap, create_heap, strided_view
from moonep.kernels import resolve_kernels
from moonep.layout import Layout
from moonep.plan_graph import GraphPlanner
from moonep.planner import Plan, make_plan, plan_shared
from moonep.validate import (
    check_expert_ids,
    check_gathered_counts,
    check_num_tokens,
    check_routing_values,
    check_tensor,
)


class DispatchResult(NamedTuple):
    x_rows: torch.Tensor  # [nvs_s, H] rows grouped by W_full row, padding rows zero
    weights_rows: torch.Tensor  # [nvs_s] fp32 route weight of each row (0 on padding); a dispatch
    #                             without weights_sK leaves the previous call's weights on valid rows
    cu_seqlens: torch.Tensor  # [epn + B] int32 offs over W_compact
    plan: Plan


class Buffer:
    """Symmetric receive/combine buffers and metadata for one EP group.

    Collective constructor: every rank of `group` builds it with the same config.
    """

    def __init__(self, config: BufferConfig, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.config = config
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
                else torch.device("cpu")
        self.device = torch.device(device)
        self.heap: SymmetricHeap = create_heap(self.group, self.device, timeout_s=config.timeout_s)
        try:
            self.layout = Layout(config, self.num_ranks, self.heap.granularity)
            self._comm = self.heap.alloc("comm", self.layout.comm_bytes)
            mapping = self.heap.map([Piece(self._comm, r, 0, self.layout.comm_bytes) for r in range(self.num_ranks)])
        except BaseException:
            self.heap.destroy()
            raise
        R, stride = self.num_ranks, self.layout.comm_bytes
        self._all = {name: strided_view(mapping, reg.offset, stride, R, reg.shape, reg.dtype)
                     for name, reg in self.layout.comm.items()}
        # row_copy / row_src: the two columns of the row_link records (strided views)
        self._all["row_copy"], self._all["row_src"] = self._all["row_link"][..., 0], self._all["row_link"][..., 1]
        self._mine = {name: t[self.rank] for name, t in self._all.items()}
        self._kernels = None  # moonep.kernels.dispatch_combine when the triton path is on
        self._fused_planner = None  # moonep.kernels.plan_fused: the whole plan() on the triton path
        self._planner = None  # the PyTorch planner replayed from a CUDA graph (CUDA, no fused planner)
        self._shared_planner = plan_shared  # SPEC 5.2-5.4 inside make_plan
        if resolve_kernels(config.kernels, self.device) == "triton":
            from moonep.kernels import dispatch_combine  # import triton: CUDA machines only

            self._kernels = dispatch_combine
            self._grid = dispatch_combine.num_sms(self.device, config.num_sms)
            self._scatter_work = dispatch_combine.scatter_work(self.device)  # calls of a Buffer are stream-ordered
            if config.fused_planner:
                from moonep.kernels import plan_fused

                self._fused_planner = plan_fused.FusedPlanner(
                    self.layout, self.rank, self._all["hist"], functools.partial(self.barrier, "dispatch:histograms"),
                    graph=self.device.type == "cuda" and config.plan_graph)
            else:
                from moonep.kernels import planner as planner_kernel

                self._shared_planner = planner_kernel.plan_shared
        if self._fused_planner is None and self.device.type == "cuda" and config.plan_graph:
            self._planner = GraphPlanner(self.layout, self.rank, self._shared_planner)
        self._rows_plan: Plan | None = None  # plan of the last dispatch: its rows are in row_src
        # True from the end of plan() until the next barrier: a peer may still have to read its
        # histograms of that plan, so a second plan() in a row must not write new ones yet
        self._hist_unsettled = False
        self._comm_stream = CommStream(self.device)  # dispatch_async / combine_async
        self.barrier("buffer:init")  # every rank is ready; the GPU barrier sets up its signals here

    # ------------------------------------------------------------------ properties
    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def epn(self) -> int:
        return self.layout.epn

    @property
    def kernel_path(self) -> str:
        """'triton' when the GPU kernels run the data path, 'torch' for the PyTorch specification."""
        return "torch" if self._kernels is None else "triton"

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def comm_stream(self) -> torch.cuda.Stream | None:
        """The stream of dispatch_async / combine_async (None on the CPU)."""
        return self._comm_stream.stream

    @property
    def pooled_plans(self) -> int:
        """How many Plans the fused planner keeps in its graph pools (each a few MB at large s;
        the pool grows to the most plans ever held at once). 0 without the fused planner's graphs."""
        planner = self._fused_planner
        return 0 if planner is None else planner.pooled_plans()

    def barrier(self, call: str) -> None:
        self._comm_stream.join()  # device barriers run in issue order, also across streams
        self.heap.barrier(call)
        self._hist_unsettled = False  # every rank got past its last read of the hist region

    def _check_alive(self, call: str) -> None:
        """Entry of every public call: the buffer is alive, and the call's work queues after the
        last async call (moonep.comm_stream)."""
        if not self._mine:  # destroy() dropped the views over unmapped memory
            raise RuntimeError(f"moonep Buffer used after destroy() (in {call})")
        self._comm_stream.join()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x_sH: torch.Tensor, weights_sK: torch.Tensor | None = None, topk_sK: torch.Tensor | None = None,
                 tokens_per_expert_E: torch.Tensor | None = None, *, plan: Plan | None = None,
                 total_num_tokens: int | None = None) -> DispatchResult:
        """Send every token row to the rows of its K experts (fresh plan from topk_sK, or a saved
        plan, as in backward). Weights travel per (token, k)."""
        self._check_alive("dispatch")
        cfg, layout = self.config, self.layout
        s = x_sH.shape[0] if isinstance(x_sH, torch.Tensor) and x_sH.dim() == 2 else -1
        check_tensor("x_sH", x_sH, shape=(max(s, 0), cfg.hidden), dtype=cfg.dtype, device=self.device)
        check_num_tokens(layout, s)
        if weights_sK is not None:
            check_tensor("weights_sK", weights_sK, shape=(s, cfg.topk), dtype=(torch.float32, cfg.dtype),
                         device=self.device)
        if plan is None:
            if topk_sK is None:
                raise ValueError("dispatch needs topk_sK for a fresh plan, or plan= a saved plan")
            # one topk row per row of x: plan() alone would plan topk's s and drop x's extra rows
            check_tensor("topk_sK", topk_sK, shape=(s, cfg.topk), dtype=(torch.int32, torch.int64), device=self.device)
            plan = self.plan(topk_sK, tokens_per_expert_E, total_num_tokens=total_num_tokens)
        else:
            if topk_sK is not None or tokens_per_expert_E is not None:
                raise ValueError("dispatch got both plan= and routing; pass one of them")
            if plan.num_tokens != s:
                raise ValueError(f"the saved plan was made for s={plan.num_tokens} tokens but x_sH has {s} rows; "
                                 "reuse a plan only with the same tokens (as in backward)")
            self.barrier("dispatch:enter")
        self._scatter(plan, x_sH, weights_sK)
        self.barrier("dispatch:rows")
        self._rows_plan = plan
        return self._expand(plan)

    def dispatch_async(self, x_sH: torch.Tensor, weights_sK: torch.Tensor | None = None,
                       topk_sK: torch.Tensor | None = None, tokens_per_expert_E: torch.Tensor | None = None, *,
                       plan: Plan | None = None, total_num_tokens: int | None = None
                       ) -> tuple[DispatchResult, CommEvent]:
        """dispatch() queued on `comm_stream` -> (result, event): read the result only after
        `event.wait()` (moonep.comm_stream has the ordering rules)."""
        return self._comm_stream.run(
            lambda: self.dispatch(x_sH, weights_sK, topk_sK, tokens_per_expert_E, plan=plan,
                                  total_num_tokens=total_num_tokens),
            (x_sH, weights_sK, topk_sK, tokens_per_expert_E))

    def plan(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None = None, *,
             total_num_tokens: int | None = None) -> Plan:
        """Exchange histograms and plan (collective) without moving tokens; pass the result to
        dispatch(plan=...). `dispatch` with routing does both."""
        self._check_alive("plan")
        cfg = self.config
        s = topk_sK.shape[0] if isinstance(topk_sK, torch.Tensor) and topk_sK.dim() == 2 else -1
        check_num_tokens(self.layout, s)
        check_tensor("topk_sK", topk_sK, shape=(s, cfg.topk), dtype=(torch.int32, torch.int64), device=self.device)
        if tokens_per_expert_E is None:
            if cfg.check_values:  # an id outside [0, E) is a ValueError, not an out-of-bounds scatter
                check_expert_ids(self.layout, topk_sK)
            if self._fused_planner is None or cfg.check_values:  # the fused planner counts topk itself
                tokens_per_expert_E = self._histogram(topk_sK)
        if tokens_per_expert_E is not None:
            check_tensor("tokens_per_expert_E", tokens_per_expert_E, shape=(cfg.num_experts,),
                         dtype=(torch.int32, torch.int64), device=self.device)
        if total_num_tokens is not None and not s <= total_num_tokens <= self.num_ranks * cfg.max_tokens:
            raise ValueError(f"total_num_tokens={total_num_tokens} must lie in [{s}, R*S="
                             f"{self.num_ranks * cfg.max_tokens}]")
        if cfg.check_values:
            check_routing_values(self.layout, topk_sK, tokens_per_expert_E)
        if self._hist_unsettled:  # plan() right after plan(): let every peer read the last histograms
            self.barrier("plan:enter")
        try:
            return self._plan_any(topk_sK, tokens_per_expert_E, total_num_tokens)
        finally:
            self._hist_unsettled = True

    def _plan_any(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None, total_num_tokens: int | None
                  ) -> Plan:
        cfg, s = self.config, topk_sK.shape[0]
        if self._fused_planner is not None:
            # histogram exchange and planning on the device (moonep.kernels.plan_fused); the
            # histogram is counted from topk_sK, which SPEC 8 requires tokens_per_expert_E to equal
            plan = self._fused_planner(topk_sK, total_num_tokens)
            if cfg.check_values:
                check_gathered_counts(self.layout, plan.counts_RE, s, total_num_tokens)
            return plan
        return self._plan(topk_sK, tokens_per_expert_E, total_num_tokens)

    def _histogram(self, topk_sK: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(self.config.num_experts, dtype=torch.int32, device=self.device)
        return counts.scatter_add_(0, topk_sK.reshape(-1).long(),
                                   torch.ones(topk_sK.numel(), dtype=torch.int32, device=self.device))

    def _plan(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor, total: int | None) -> Plan:
        self._all["hist"][:, self.rank, :] = tokens_per_expert_E.to(torch.int32)
        self.barrier("dispatch:histograms")
        counts_RE = self._mine["hist"].clone()
        if self.config.check_values:
            check_gathered_counts(self.layout, counts_RE, topk_sK.shape[0], total)
        if self._planner is not None:
            return self._planner(topk_sK, counts_RE, total)
        return make_plan(self.layout, self.rank, topk_sK, counts_RE, total_num_tokens=total, shared=self._shared_planner)

    def _scatter(self, plan: Plan, x_sH: torch.Tensor, weights_sK: torch.Tensor | None, *, rows: bool = True) -> None:
        layout, mine, every = self.layout, self._mine, self._all
        if self._kernels is not None:  # receiver padding marks move to _expand (after the barrier)
            self._kernels.scatter(x_sH, weights_sK, plan.dst_rank_sK, plan.dst_row_sK, plan.copy_row_sK, plan.sent_sK,
                                  every["recv"], every["row_weight"], every["row_link"],
                                  self.rank * self.config.max_tokens * plan.topk, self._grid, self._scatter_work,
                                  rows=rows)
            return
        s, K = plan.num_tokens, plan.topk
        dst_rank = plan.dst_rank_sK.reshape(-1).long()
        dst_row = plan.dst_row_sK.reshape(-1).long()
        # this rank as receiver: padding rows copy from the zero row, weight 0, no source
        pad = ~self._valid_rows(plan)
        mine["row_copy"][: plan.nvs_s].masked_fill_(pad, layout.zero_row)
        mine["row_weight"][: plan.nvs_s].masked_fill_(pad, 0.0)
        mine["row_src"][: plan.nvs_s].masked_fill_(pad, -1)
        # this rank as sender: metadata for every entry, the row once per (token, rank)
        idx = (dst_rank, dst_row)
        flat = torch.arange(s * K, device=self.device, dtype=torch.int32)
        every["row_copy"].index_put_(idx, plan.copy_row_sK.reshape(-1))
        every["row_src"].index_put_(idx, self.rank * self.config.max_tokens * K + flat)
        if weights_sK is not None:
            every["row_weight"].index_put_(idx, weights_sK.reshape(-1).float())
        sent = plan.sent_sK.reshape(-1)
        rows_to = (torch.where(sent, dst_rank, self.rank), torch.where(sent, dst_row, layout.trash_row))
        token = torch.arange(s * K, device=self.device) // K
        every["recv"].index_put_(rows_to, x_sH.index_select(0, token))

    def _valid_rows(self, plan: Plan) -> torch.Tensor:
        """[nvs_s] bool: rows of this rank that receive a token (not padding)."""
        offs = plan.offs_RG[self.rank].long()
        sizes = plan.group_rows_RG[self.rank].long()
        pad = self.config.token_padding
        padded = (sizes + pad - 1) // pad * pad
        row = torch.arange(plan.nvs_s, device=self.device)
        g = torch.searchsorted(offs, row, right=True).clamp(max=offs.numel() - 1)
        return (row < offs[-1]) & (row - (offs[g] - padded[g]) < sizes[g])

    def _expand(self, plan: Plan, *, copy: bool = True) -> DispatchResult:
        recv = self._mine["recv"]
        x_rows = recv[: plan.nvs_s]
        if self._kernels is not None:
            mine = self._mine
            self._kernels.expand(recv, mine["row_weight"], mine["row_link"], plan.offs_RG[self.rank],
                                 plan.group_rows_RG[self.rank], plan.nvs_s, self.layout.zero_row,
                                 self.config.token_padding, copy=copy)
        else:
            x_rows.copy_(recv.index_select(0, self._mine["row_copy"][: plan.nvs_s].long()))
        return DispatchResult(x_rows, self._mine["row_weight"][: plan.nvs_s], plan.cu_seqlens, plan)

    # ------------------------------------------------------------------ combine
    def combine_input(self, plan: Plan) -> torch.Tensor:
        """[nvs_s, H] symmetric rows; writing y rows here makes combine copy nothing."""
        self._check_alive("combine_input")
        return self._mine["comb"][: plan.nvs_s]

    def combine(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum each token's K rows back on its source rank in fp32 -> (y_sH, scalars_sK).

        `row_scalars` [nvs_s] fp32 (optional) are gathered per (token, k), e.g. the gradient of
        the route weights in dispatch's backward."""
        self._check_alive("combine")
        H = self.config.hidden
        check_tensor("y_rows", y_rows, shape=(plan.nvs_s, H), dtype=self.config.dtype, device=self.device)
        if row_scalars is not None:
            check_tensor("row_scalars", row_scalars, shape=(plan.nvs_s,), dtype=torch.float32, device=self.device)
        if self._kernels is not None:
            return self._push_combine(plan, y_rows, row_scalars)
        comb = self.combine_input(plan)
        if y_rows.data_ptr() != comb.data_ptr():
            comb.copy_(y_rows)
        if row_scalars is not None:
            self._mine["row_scalar"][: plan.nvs_s].copy_(row_scalars)
        self.barrier("combine:rows")
        idx = (plan.dst_rank_sK.long(), plan.dst_row_sK.long())
        rows_sKH = self._all["comb"][idx]
        y_sH = rows_sKH[:, 0].float()
        for k in range(1, plan.topk):
            y_sH += rows_sKH[:, k].float()
        scalars_sK = self._all["row_scalar"][idx].clone() if row_scalars is not None else None
        self.barrier("combine:done")
        return y_sH.to(self.config.dtype), scalars_sK

    def combine_async(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None = None
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], CommEvent]:
        """combine() queued on `comm_stream` -> ((y_sH, scalars_sK), event); see dispatch_async."""
        return self._comm_stream.run(lambda: self.combine(plan, y_rows, row_scalars), (y_rows, row_scalars))

    def _push_combine(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """combine on the triton path: destinations push rows into the sources' landing rows."""
        mine, every, K = self._mine, self._all, plan.topk
        if plan is not self._rows_plan:
            # row_src describes another dispatch's rows; every rank runs the same call sequence, so
            # every rank takes this branch together
            self.barrier("combine:enter")
            self._scatter(plan, y_rows, None, rows=False)
            self._expand(plan, copy=False)
            self.barrier("combine:meta")
            self._rows_plan = plan
        self._kernels.push(y_rows, row_scalars, mine["row_link"], plan.nvs_s, every["land"], every["land_scalar"],
                           self.config.max_tokens * K, self._grid)
        self.barrier("combine:rows")
        s = plan.num_tokens
        y_sH = torch.empty(s, self.config.hidden, dtype=self.config.dtype, device=self.device)
        self._kernels.reduce(mine["land"], y_sH, K)
        scalars_sK = mine["land_scalar"][: s * K].view(s, K).clone() if row_scalars is not None else None
        self.barrier("combine:done")
        return y_sH, scalars_sK

    # ------------------------------------------------------------------ experts (see moonep.pools)
    def prefetch_weight(self, plan: Plan, layer) -> None:
        """Copy every planned remote expert of `layer` into this rank's slots."""
        self._check_alive("prefetch_weight")
        layer.pools.prefetch(plan, layer)

    def reduce_grad(self, plan: Plan, layer) -> None:
        """Fold every slot's fp32 weight gradient into its owner's grad rows; zero the slots."""
        self._check_alive("reduce_grad")
        layer.pools.reduce_grad(plan, layer)

    def reduce_grad_async(self, plan: Plan, layer) -> CommEvent:
        """reduce_grad() queued on `comm_stream` -> event (the layer's backward goes on upstream
        while the slot gradients travel). The next call on the buffer orders after it, so the next
        layer's slot gradients never land in a reduce pool still being read or zeroed; wait on the
        event, or call `wait_pending()`, before reading the grad rows (e.g. after backward)."""
        _, event = self._comm_stream.run(lambda: self.reduce_grad(plan, layer), (), keep=(plan,))
        return event

    def wait_pending(self) -> None:
        """Make the current stream wait for the last async call (no host sync); e.g. before the
        optimizer reads grad rows that reduce_grad_async writes."""
        self._comm_stream.join()

    def destroy(self) -> None:
        """Release all symmetric memory (idempotent). Tensors returned earlier become invalid."""
        self._all, self._mine = {}, {}
        self.heap.destroy()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
