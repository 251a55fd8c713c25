"""Buffer: moonep's public EP communication object (docs/moonep.md §6).

Protocol of one call (every rank runs the same sequence of calls; every barrier names its call):

plan (collective; the data path exchanges the histograms, barrier "dispatch:histograms", and
    plans): a second plan() with no other call in between first passes barrier "plan:enter", so no
    peer overwrites histograms this rank has not read yet.
dispatch (fresh plan): plan, then the path's scatter (sender side), barrier "dispatch:rows", the
    path's expand (receiver side).
dispatch (saved plan): barrier "dispatch:enter" replaces planning, so no peer writes rows this rank
    may still be reading.
combine: the path's protocol (moonep.datapath.reference: pull, barriers "combine:rows" and
    "combine:done"; moonep.datapath.triton_path: push into landing rows, the same barriers; with
    BufferOptions.combine_reduce "destination" both push one partial row per token and rank).

The data path (moonep.datapath: the PyTorch specification or the Triton kernels) is chosen once,
when the Buffer is built (BufferOptions.kernels); both give the same bits.

dispatch_async / combine_async / reduce_grad_async queue the same calls on the buffer's communication
stream and return a CommEvent to wait on (moonep.comm_stream: ordering and memory rules).

Out of step: a barrier that times out (a peer died, raised, or called something else), or a
data-dependent check that rejects one rank's routing (R > 1: its peers may already be waiting in the
histogram exchange), poisons the buffer: every later call on it raises RuntimeError naming the cause,
instead of pairing this rank's barriers with the peers' earlier ones. Checks every rank makes alike
(shapes, s across ranks after the exchange) leave the buffer usable.

Returned rows are zero-copy views into symmetric memory, valid until the next call on this buffer;
clone what must outlive it (autograd saves). No call synchronises with the host unless value checks
are on (BufferOptions.check_values).

Bad input: with value checks on, plan and dispatch run every rank-local input check first and the
ranks agree on the verdict (one all_reduce of a flag) before anything moves, so one rank's invalid
input makes every rank raise in that call and leaves nothing half-done (a rank raising alone would
leave its peers in the exchange, paired with its retry). A plan is accepted only by the Buffer that
made it; combine refuses one that no dispatch used, and the last dispatch's receive rows with another
plan (host bookkeeping, no sync; rows computed from an earlier dispatch's cannot be traced).

Legend: s tokens of this rank, K top-k, H hidden, E experts, R ranks, nvs_s rows of this call.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from moonep.comm_stream import CommEvent, CommStream
from moonep.config import BufferConfig
from moonep.datapath import CommViews, DataPath, build_path, resolve_kernels
from moonep.errors import MoonEPTimeoutError
from moonep.heap import Piece, SymmetricHeap, create_heap, strided_view
from moonep.layout import Layout
from moonep.planner.plan import Plan
from moonep.validate import (
    ENTRIES_TOTAL,
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
        self.check_values = config.options.checks_values(self.device)
        # entries mode runs on the PyTorch data path: 'auto' picks it there, an explicit 'triton' is refused
        kind = "torch" if config.entries and config.options.kernels == "auto" else \
            resolve_kernels(config.options.kernels, self.device)
        if config.entries and kind != "torch":
            raise ValueError("BufferConfig.entries=True runs on the PyTorch data path only (the Triton kernels and "
                             "the fused planner take s*K entries per rank); build the buffer with "
                             "BufferOptions(kernels='torch')")
        if config.options.fused_expert_gemm and kind != "triton":
            raise ValueError(f"BufferOptions.fused_expert_gemm needs the triton data path (CUDA), this buffer's "
                             f"is {kind!r} on {self.device}; set fused_expert_gemm=False")
        if config.options.expert_gemm != "torch":
            _check_quack(config.options.expert_gemm, kind, self.device)
        self.heap: SymmetricHeap = create_heap(self.group, self.device, timeout_s=config.options.timeout_s)
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
        # True from the end of plan() until the next barrier: a peer may still have to read its
        # histograms of that plan, so a second plan() in a row must not write new ones yet
        self._hist_unsettled = False
        self._plans: weakref.WeakSet[Plan] = weakref.WeakSet()  # the plans this buffer made (plan())
        self._dispatched: weakref.WeakSet[Plan] = weakref.WeakSet()  # the plans a dispatch laid rows out with
        self._last_dispatch: weakref.ref[Plan] | None = None  # the plan of the rows in the receive buffer
        self._poisoned: str | None = None  # why every later call is refused (see _poison)
        self._comm_stream = CommStream(self.device)  # dispatch_async / combine_async
        self.path: DataPath = build_path(kind, CommViews(self.layout, self.rank, self.device, config.options,
                                                         self._all, self._mine, self.barrier))
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
        return self.path.name

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def comm_stream(self) -> torch.cuda.Stream | None:
        """The stream of dispatch_async / combine_async (None on the CPU)."""
        return self._comm_stream.stream

    @property
    def pooled_plans(self) -> int:
        """How many Plans the planner keeps for reuse (the fused planner's graph pools: each a few MB
        at large s, growing to the most plans ever held at once; 0 on the PyTorch path)."""
        return self.path.pooled_plans()

    def barrier(self, call: str) -> None:
        self._comm_stream.join()  # device barriers run in issue order, also across streams
        try:
            self.heap.barrier(call)
        except MoonEPTimeoutError as err:
            self._poison(f"barrier {call!r} timed out ({err})")
            raise
        self._hist_unsettled = False  # every rank got past its last read of the hist region

    def _poison(self, reason: str) -> None:
        """The ranks' call sequences may be out of step: refuse every later call, saying why (§6.7, §8)."""
        if self._poisoned is None:
            self._poisoned = reason

    def _check_alive(self, call: str) -> None:
        """Entry of every public call: the buffer is alive, and the call's work queues after the
        last async call (moonep.comm_stream)."""
        if not self._mine:  # destroy() dropped the views over unmapped memory
            raise RuntimeError(f"moonep Buffer used after destroy() (in {call})")
        if self._poisoned is not None:
            raise RuntimeError(f"moonep Buffer refuses {call}: an earlier call left the ranks out of step "
                               f"({self._poisoned}); destroy it and build a new Buffer on every rank")
        self._comm_stream.join()

    def _check_plan(self, call: str, plan: Plan) -> None:
        """A saved plan must be one this buffer made: its rows and slots index this buffer's memory
        and the peers of this buffer's group (a plan of another buffer may have other sizes)."""
        if not isinstance(plan, Plan) or plan not in self._plans:
            raise ValueError(f"{call} got a plan this Buffer did not make ({type(plan).__name__}); pass a plan "
                             "returned by this buffer's plan() or dispatch()")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x_sH: torch.Tensor, weights_sK: torch.Tensor | None = None, topk_sK: torch.Tensor | None = None,
                 tokens_per_expert_E: torch.Tensor | None = None, *, plan: Plan | None = None,
                 total_num_tokens: int | None = None) -> DispatchResult:
        """Send every token row to the rows of its K experts (fresh plan from topk_sK, or a saved
        plan, as in backward). Weights travel per (token, k)."""
        self._check_alive("dispatch")
        cfg, layout = self.config, self.layout
        rejected = None
        try:
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
                check_tensor("topk_sK", topk_sK, shape=(s, cfg.topk), dtype=(torch.int32, torch.int64),
                             device=self.device)
                tokens_per_expert_E = self._check_plan_inputs(topk_sK, tokens_per_expert_E, total_num_tokens)
            else:
                if topk_sK is not None or tokens_per_expert_E is not None:
                    raise ValueError("dispatch got both plan= and routing; pass one of them")
                self._check_plan("dispatch", plan)
                if plan.num_tokens != s:
                    raise ValueError(f"the saved plan was made for s={plan.num_tokens} tokens but x_sH has {s} "
                                     "rows; reuse a plan only with the same tokens (as in backward)")
        except ValueError as err:
            rejected = err
        self._agree_on_inputs(rejected, "dispatch")
        if plan is None:
            plan = self._plan_collective(topk_sK, tokens_per_expert_E, total_num_tokens)
        else:
            self.barrier("dispatch:enter")
        self.path.scatter(plan, x_sH, weights_sK)
        self.barrier("dispatch:rows")
        self.path.expand(plan)
        self._dispatched.add(plan)
        self._last_dispatch = weakref.ref(plan)
        mine = self._mine
        return DispatchResult(mine["recv"][: plan.nvs_s], mine["row_weight"][: plan.nvs_s], plan.cu_seqlens, plan)

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
        rejected = None
        try:
            tokens_per_expert_E = self._check_plan_inputs(topk_sK, tokens_per_expert_E, total_num_tokens)
        except ValueError as err:
            rejected = err
        self._agree_on_inputs(rejected, "plan")
        return self._plan_collective(topk_sK, tokens_per_expert_E, total_num_tokens)

    def _agree_on_inputs(self, rejected: ValueError | None, call: str) -> None:
        """With check_values: one all_reduce tells every rank whether any rank rejected its input, before
        anything moves, so all ranks raise together and a retry starts from a clean state on every rank
        (a rank raising alone would leave its peers in the histogram exchange, paired with its retry).
        Without check_values (the GPU default) inputs are trusted to be valid on every rank."""
        if self.check_values and self.num_ranks > 1:
            flag = torch.tensor([int(rejected is not None)], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if rejected is None and flag.item():
                raise ValueError(f"{call}: another rank of the EP group rejected its input (its error says why); "
                                 "nothing was sent on any rank, so the call can be retried on every rank")
        if rejected is not None:
            raise rejected

    def _check_plan_inputs(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None,
                           total_num_tokens: int | None) -> torch.Tensor | None:
        """The rank-local checks of plan(); returns the histogram to plan with (None: the path counts)."""
        cfg = self.config
        s = topk_sK.shape[0] if isinstance(topk_sK, torch.Tensor) and topk_sK.dim() == 2 else -1
        check_num_tokens(self.layout, s)
        check_tensor("topk_sK", topk_sK, shape=(s, cfg.topk), dtype=(torch.int32, torch.int64), device=self.device)
        if tokens_per_expert_E is not None:
            check_tensor("tokens_per_expert_E", tokens_per_expert_E, shape=(cfg.num_experts,),
                         dtype=(torch.int32, torch.int64), device=self.device)
        if total_num_tokens is not None and cfg.entries:
            raise ValueError(ENTRIES_TOTAL)
        if total_num_tokens is not None and not s <= total_num_tokens <= self.num_ranks * cfg.max_tokens:
            raise ValueError(f"total_num_tokens={total_num_tokens} must lie in [{s}, R*S="
                             f"{self.num_ranks * cfg.max_tokens}]")
        if tokens_per_expert_E is None:
            if self.check_values:  # an id outside [0, E) is a ValueError, not an out-of-bounds scatter
                check_expert_ids(self.layout, topk_sK)
            if not self.path.counts_topk or self.check_values:
                tokens_per_expert_E = self._histogram(topk_sK)
        if self.check_values:
            check_routing_values(self.layout, topk_sK, tokens_per_expert_E)
        return tokens_per_expert_E

    def _plan_collective(self, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None,
                         total_num_tokens: int | None) -> Plan:
        s = topk_sK.shape[0]
        if self._hist_unsettled:  # plan() right after plan(): let every peer read the last histograms
            self.barrier("plan:enter")
        check = (lambda counts_RE: check_gathered_counts(self.layout, counts_RE, s, total_num_tokens)) \
            if self.check_values else None
        try:
            plan = self.path.plan(topk_sK, tokens_per_expert_E, total_num_tokens, check)
        finally:
            self._hist_unsettled = True
        self._plans.add(plan)
        return plan

    def _histogram(self, topk_sK: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(self.config.num_experts, dtype=torch.int32, device=self.device)
        ids = topk_sK.reshape(-1).long()
        if self.config.entries:  # absent entries (-1) count nowhere: index 0 with weight 0, no host sync
            present = ids >= 0
            return counts.scatter_add_(0, ids.clamp(min=0), present.to(torch.int32))
        return counts.scatter_add_(0, ids, torch.ones(topk_sK.numel(), dtype=torch.int32, device=self.device))

    # ------------------------------------------------------------------ combine
    def combine_input(self, plan: Plan) -> torch.Tensor:
        """[nvs_s, H] symmetric rows; writing y rows here makes combine copy nothing."""
        self._check_alive("combine_input")
        self._check_plan("combine_input", plan)
        if "comb" not in self._mine:
            raise ValueError("combine_input: this buffer sums at the destination (BufferOptions.combine_reduce="
                             "'destination'), which has no combine rows; pass the y rows to combine() itself "
                             "(with row_weights), or build the buffer with combine_reduce='source'")
        return self._mine["comb"][: plan.nvs_s]

    def combine(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None = None, *,
                row_weights: torch.Tensor | None = None, add_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum each token's K rows back on its source rank in fp32 -> (y_sH, scalars_sK), in the
        order BufferOptions.combine_reduce names.

        `row_scalars` [nvs_s] fp32 (optional) are gathered per (token, k), e.g. the gradient of
        the route weights in dispatch's backward. A row's value is y_rows (+ add_rows, [nvs_s, H]
        like y_rows) (* row_weights, [nvs_s] fp32), each step in fp32: the route-weight scale and a
        sum of two row tensors without a pass of their own and without rounding in between ("source"
        rounds each row's value once before sending it)."""
        self._check_alive("combine")
        self._check_plan("combine", plan)
        H = self.config.hidden
        check_tensor("y_rows", y_rows, shape=(plan.nvs_s, H), dtype=self.config.dtype, device=self.device)
        if row_scalars is not None:
            check_tensor("row_scalars", row_scalars, shape=(plan.nvs_s,), dtype=torch.float32, device=self.device)
        if row_weights is not None:
            check_tensor("row_weights", row_weights, shape=(plan.nvs_s,), dtype=torch.float32, device=self.device)
        if add_rows is not None:
            check_tensor("add_rows", add_rows, shape=(plan.nvs_s, H), dtype=self.config.dtype, device=self.device)
        self._check_rows_plan(plan, y_rows, add_rows)
        return self.path.combine(plan, y_rows, row_scalars, row_weights, add_rows)

    def _check_rows_plan(self, plan: Plan, *rows: torch.Tensor | None) -> None:
        """combine's rows must be laid out by a dispatch with `plan` (see the module docstring): another plan
        sums other rows into each token, silently."""
        if plan not in self._dispatched:
            raise ValueError("combine got a plan that no dispatch of this Buffer used, so no rows are laid out by it; "
                             "pass the plan of the dispatch whose rows y_rows was computed from (its "
                             "DispatchResult.plan)")
        recv = self._mine["recv"]
        lo, hi = recv.data_ptr(), recv.data_ptr() + recv.numel() * recv.element_size()
        last = self._last_dispatch() if self._last_dispatch is not None else None
        for t in rows:
            if t is not None and plan is not last and t.data_ptr() < hi and lo < t.data_ptr() + t.nbytes:
                raise ValueError("combine got rows of the receive buffer, which hold the last dispatch's rows, with "
                                 "another plan than that dispatch's; pass the last dispatch's plan "
                                 "(DispatchResult.plan), or clone rows before a later dispatch overwrites them")

    def combine_async(self, plan: Plan, y_rows: torch.Tensor, row_scalars: torch.Tensor | None = None, *,
                      row_weights: torch.Tensor | None = None, add_rows: torch.Tensor | None = None
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], CommEvent]:
        """combine() queued on `comm_stream` -> ((y_sH, scalars_sK), event); see dispatch_async."""
        return self._comm_stream.run(
            lambda: self.combine(plan, y_rows, row_scalars, row_weights=row_weights, add_rows=add_rows),
            (y_rows, row_scalars, row_weights, add_rows))

    # ------------------------------------------------------------------ experts (see moonep.pools)
    def prefetch_weight(self, plan: Plan, layer) -> None:
        """Copy every planned remote expert of `layer` into this rank's slots."""
        self._check_alive("prefetch_weight")
        self._check_plan("prefetch_weight", plan)
        layer.pools.prefetch(plan, layer)

    def reduce_grad(self, plan: Plan, layer) -> None:
        """Fold every slot's fp32 weight gradient into its owner's grad rows; zero the slots."""
        self._check_alive("reduce_grad")
        self._check_plan("reduce_grad", plan)
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
        self._all.clear()  # the data path holds these dicts too
        self._mine.clear()
        self.heap.destroy()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _check_quack(choice: str, kind: str, device: torch.device) -> None:
    """BufferOptions.expert_gemm="quack" / "quack_wgrad" runs on the triton path of an sm90 GPU with quack-kernels
    installed."""
    if kind != "triton":
        raise ValueError(f"BufferOptions.expert_gemm={choice!r} needs the triton data path (CUDA), this buffer's is "
                         f"{kind!r} on {device}; set expert_gemm='torch'")
    from moonep.kernels import quack_gemm

    reason = quack_gemm.unavailable(device.index if device.index is not None else torch.cuda.current_device())
    if reason:
        raise ValueError(f"BufferOptions.expert_gemm={choice!r}: {reason}; or set expert_gemm='torch'")
