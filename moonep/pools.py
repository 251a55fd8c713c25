"""ExpertPools: expert weights, the fp32 grad mirror, and the slot/reduce pools shared by layers.

Per projection p with matrices of shape (in, out):
    weight segment of each layer   [epn, in, out] dtype   this rank's canonical expert rows
    grad segment of each layer     [epn, in, out] fp32    their gradients (the only grads the
                                                          framework ever reduces)
    slot pool (one for all layers) [B, in, out]   dtype   prefetched remote experts
    reduce pool (one for all)      [B, in, out]   fp32    slot gradients, folded back by reduce_grad
Views per layer (same physical memory, docs/moonep.md §4.2):
    w_full [E+B, in, out]  every rank's rows (mapped from the owners) then this rank's slots
    w_compact [epn+B, ...] this rank's rows then its slots: what the grouped GEMM reads
    g_full / g_compact     the same in fp32 with the reduce pool behind rows [E, E+B) / [epn, epn+B)
Per pool: w_slots_all / g_slots_all [R, B, in, out], every rank's slots.

The copies and folds themselves are the Buffer's data path (moonep.datapath: the PyTorch
specification or the Triton kernels); on CUDA, prefetch_async runs them on a side
stream. Every remote expert a rank computes needs a slot: B >= Layout.remote_experts (epn at R > 1;
none on one rank, where no slot or reduce pool is allocated; BufferConfig.num_slots None).

The slots hold one layer's copies at a time. `ensure(plan, layer)` re-prefetches when another
layer (or another plan) used them since; all ranks run the same call sequence, so they agree. In
backward a layer refills them for the layer before it (`previous_forward`) once its own last read
of the slots is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moonep.buffer import Buffer
from moonep.heap import Piece, view
from moonep.planner.plan import Plan


@dataclass(frozen=True, eq=False)
class LayerExperts:
    pools: ExpertPools
    index: int
    w_full: dict[str, torch.Tensor]
    w_compact: dict[str, torch.Tensor]
    w_local: dict[str, torch.Tensor]
    g_full: dict[str, torch.Tensor]
    g_compact: dict[str, torch.Tensor]
    g_local: dict[str, torch.Tensor]


class ExpertPools:
    """Collective: every rank builds it with the same projections, then adds the same layers.

    wgrad_scale: weight grads accumulate as wgrad_scale * x^T grad: a trainer folds its loss-mean factor
        (e.g. 1 / world size) in here instead of scaling the fp32 grads in a pass of their own.
    chain_prefetch: backward refills the slots for the previous layer early (previous_forward). Turn it off
        where the forwards are recomputed in backward (activation checkpointing): the recompute plans again,
        so the early copy (made with the first forward's plan) would be copied once more.
    """

    def __init__(self, buffer: Buffer, projections: dict[str, tuple[int, int]],
                 dtype: torch.dtype | None = None, *, wgrad_scale: float = 1.0, chain_prefetch: bool = True) -> None:
        if not projections:
            raise ValueError("ExpertPools needs at least one projection, e.g. moonep.glu_projections(H, F) = "
                             "{'gate_up': (H, 2F), 'down': (F, H)}")
        for name, shape in projections.items():
            if len(shape) != 2 or any((not isinstance(n, int)) or n < 1 for n in shape):
                raise ValueError(f"projection {name!r} has shape {shape}; expected (in_features, out_features)")
        layout = buffer.layout
        if layout.num_slots < layout.remote_experts:
            raise ValueError(
                f"ExpertPools needs one prefetch slot per remote expert a rank may compute: the buffer has "
                f"num_slots={layout.num_slots} < E // R = {layout.remote_experts}, so tokens of a remote expert "
                "without a slot would meet no weights; build the BufferConfig with num_slots=None (derived)")
        self.buffer = buffer
        self.heap = buffer.heap
        self.projections = dict(projections)
        self.dtype = dtype or buffer.config.dtype
        self.layers: list[LayerExperts] = []
        self.wgrad_scale = wgrad_scale
        self._owner: tuple[int, Plan] | None = None  # (layer index, plan) whose copies the slots hold
        self._side: torch.cuda.Stream | None = None  # prefetch_async's stream (CUDA)
        self._prefetched: torch.cuda.Event | None = None  # completion of the last prefetch_async
        self._zero_pending: set[tuple[int, str]] = set()  # (layer index, projection): see defer_zero_grads
        self._last_forward: tuple[LayerExperts, Plan] | None = None  # see previous_forward
        self.chain_prefetch = chain_prefetch
        self._path = buffer.path
        # one rank has no remote expert, so its plans fill no slot (§5.2): prefetch and reduce_grad
        # have nothing to copy, fold or zero, and skip their launches
        self._uses_slots = buffer.num_ranks > 1
        heap, R = buffer.heap, buffer.num_ranks
        B = layout.num_slots
        self.w_slots_all: dict[str, torch.Tensor] = {}
        self.g_slots_all: dict[str, torch.Tensor] = {}
        self._slot_segments: dict[str, tuple] = {}
        for name, shape in self.projections.items():
            w_bytes = layout.expert_block_bytes(shape, self.dtype, B)
            g_bytes = layout.expert_block_bytes(shape, torch.float32, B)
            layout.expert_block_bytes(shape, self.dtype, layout.epn)
            if B == 0:  # one rank: no pools (Layout.remote_experts), empty views keep the shapes
                self._slot_segments[name] = (None, None)
                self.w_slots_all[name] = torch.empty((R, 0, *shape), dtype=self.dtype, device=buffer.device)
                self.g_slots_all[name] = torch.empty((R, 0, *shape), dtype=torch.float32, device=buffer.device)
                continue
            w_seg = heap.alloc(f"w_slots:{name}", w_bytes)
            g_seg = heap.alloc(f"g_slots:{name}", g_bytes)
            self._slot_segments[name] = (w_seg, g_seg)
            w_map = heap.map([Piece(w_seg, r, 0, w_bytes) for r in range(R)])
            g_map = heap.map([Piece(g_seg, r, 0, g_bytes) for r in range(R)])
            self.w_slots_all[name] = view(w_map, 0, (R, B, *shape), self.dtype)
            self.g_slots_all[name] = view(g_map, 0, (R, B, *shape), torch.float32)

    def add_layer(self) -> LayerExperts:
        """Collective: allocate one MoE layer's expert weights and grad mirror (zero-initialised)."""
        buf, heap = self.buffer, self.heap
        layout, R, rank = buf.layout, buf.num_ranks, buf.rank
        E, B, epn = buf.num_experts, layout.num_slots, layout.epn
        index = len(self.layers)
        views: dict[str, dict[str, torch.Tensor]] = {k: {} for k in
                                                     ("w_full", "w_compact", "w_local", "g_full", "g_compact", "g_local")}
        for name, shape in self.projections.items():
            w_slot_seg, g_slot_seg = self._slot_segments[name]
            for kind, dtype, slot_seg in (("w", self.dtype, w_slot_seg), ("g", torch.float32, g_slot_seg)):
                local_bytes = layout.expert_block_bytes(shape, dtype, epn)
                slot = [Piece(slot_seg, rank, 0, layout.expert_block_bytes(shape, dtype, B))] if B else []
                seg = heap.alloc(f"{kind}:{index}:{name}", local_bytes)
                full = heap.map([Piece(seg, r, 0, local_bytes) for r in range(R)] + slot)
                compact = heap.map([Piece(seg, rank, 0, local_bytes), *slot])
                views[f"{kind}_full"][name] = view(full, 0, (E + B, *shape), dtype)
                views[f"{kind}_compact"][name] = view(compact, 0, (epn + B, *shape), dtype)
                views[f"{kind}_local"][name] = views[f"{kind}_compact"][name][:epn]
        layer = LayerExperts(self, index, **views)
        self.layers.append(layer)
        return layer

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights over all projections (one slot's worth of prefetch)."""
        return sum(i * o for i, o in self.projections.values()) * torch.empty((), dtype=self.dtype).element_size()

    def prefetch_bytes(self, plan: Plan) -> torch.Tensor:
        """Bytes this rank pulls in `prefetch(plan, ...)`, as a device scalar (no host sync)."""
        return (plan.slot_expert_RB[plan.rank] >= 0).sum() * self.expert_bytes()

    @property
    def slot_plan(self) -> Plan | None:
        """The plan whose expert copies the slots hold now (None before the first prefetch)."""
        return None if self._owner is None else self._owner[1]

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, plan: Plan, layer: LayerExperts) -> None:
        """Pull each planned remote expert's rows from its owner into this rank's slots (local
        stream order; the owners' rows were published by the barriers of the dispatch before)."""
        if self._uses_slots:
            for name in self.projections:
                self._path.prefetch(plan, layer.w_full[name])
        self._owner = (layer.index, plan)

    def prefetch_async(self, plan: Plan, layer: LayerExperts) -> None:
        """prefetch on a side stream, so the copies overlap whatever the caller queues next (the
        token dispatch); `wait_prefetch()` orders them before the slots are read. The side stream
        first waits for the current stream: earlier readers of the slots (the previous layer's
        GEMMs) are done and the owners' rows are the ones published by the last barrier. On the CPU
        this is prefetch(), and so it is where no slot is used."""
        if self.buffer.device.type != "cuda" or not self._uses_slots:
            self.prefetch(plan, layer)
            return
        side = self._side_after_current(self.buffer.device)
        with torch.cuda.stream(side):
            self.prefetch(plan, layer)
        self._prefetched = torch.cuda.Event()
        self._prefetched.record(side)

    def _side_after_current(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream (created once), ordered after the current stream's work so far."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        self._side.wait_stream(torch.cuda.current_stream(device))
        return self._side

    @property
    def uses_slots(self) -> bool:
        """Whether the planner can fill slots (more than one rank): prefetch and reduce_grad have work."""
        return self._uses_slots

    def ensure_async(self, plan: Plan, layer: LayerExperts) -> None:
        """ensure() through prefetch_async; pair with wait_prefetch()."""
        if self._owner is None or self._owner[0] != layer.index or self._owner[1] is not plan:
            self.prefetch_async(plan, layer)

    def previous_forward(self, layer: LayerExperts, plan: Plan, track: bool) -> tuple[LayerExperts, Plan] | None:
        """The (layer, plan) of the expert forward that ran just before this one in the same pass
        (an earlier layer: its backward runs right after this layer's), or None; then remembers
        this one if `track` (autograd will run its backward). expert_glu's backward prefetches
        that layer's copies as soon as its own last read of the slots is queued, so the copies
        travel during its weight-gradient GEMMs; the next backward's `ensure_async` then finds
        them in place. A wrong guess (e.g. recomputed forwards) only costs the early copy: ensure
        still compares the layer and the plan."""
        prev = self._last_forward
        self._last_forward = (layer, plan) if track and self.chain_prefetch else None
        return prev if prev is not None and prev[0].index < layer.index else None

    def wait_prefetch(self) -> None:
        """Order the last prefetch_async before the current stream's next work (no host sync)."""
        if self._prefetched is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self._prefetched)
            self._prefetched = None

    def ensure(self, plan: Plan, layer: LayerExperts) -> None:
        """Prefetch again only if the slots hold another layer's or plan's copies."""
        if self._owner is None or self._owner[0] != layer.index or self._owner[1] is not plan:
            self.prefetch(plan, layer)

    def accumulate_wgrad(self, layer: LayerExperts, name: str, x_rows: torch.Tensor, grad_rows: torch.Tensor,
                         offs: torch.Tensor, scale: float = 1.0) -> None:
        """layer.g_compact[name] (fp32, [epn + B, I, O]) += scale * x^T grad per W_compact group
        (expert_glu passes the wgrad_scale its forward saw). Local rows declared zero by
        defer_zero_grads get the product instead of adding to it."""
        stale = self._claim_stale(layer, name)
        self._path.accumulate_wgrad(layer.g_compact[name], x_rows, grad_rows, offs, scale,
                                    self.buffer.layout.epn if stale else 0)

    def defer_zero_grads(self, layer: LayerExperts, names: tuple[str, ...] | None = None) -> None:
        """Declare layer.g_local[name] zero without writing it: the layer's next accumulate_wgrad
        overwrites it instead of adding (saves a zeroing pass and the first pass's read of the fp32
        grads). Until then its memory holds stale values: call settle_grads() before reading the grads
        (expert_glu's backward of every layer normally makes it a no-op)."""
        for name in names if names is not None else tuple(self.projections):
            if name not in self.projections:
                raise ValueError(f"defer_zero_grads: unknown projection {name!r}; the pools have "
                                 f"{sorted(self.projections)}")
            self._zero_pending.add((layer.index, name))

    def settle_grads(self) -> None:
        """Zero every grad still declared zero by defer_zero_grads (a layer without a backward)."""
        for layer in self.layers:
            for name in self.projections:
                if self._claim_stale(layer, name):
                    layer.g_local[name].zero_()

    def _claim_stale(self, layer: LayerExperts, name: str) -> bool:
        """True, once, when layer.g_local[name] was declared zero and not written since."""
        key = (layer.index, name)
        if key not in self._zero_pending:
            return False
        self._zero_pending.remove(key)
        return True

    # ------------------------------------------------------------------ reduce_grad
    def reduce_grad(self, plan: Plan, layer: LayerExperts) -> None:
        """Add every slot's gradient into the owner's grad rows, in ascending (rank, slot) order
        (deterministic), then zero the consumed slots.

        barrier "reduce_grad:ready" -> owners read peers' reduce pools -> barrier
        "reduce_grad:read" -> each rank zeroes its own reduce pool."""
        buf = self.buffer
        for name in self.projections:  # the owners add into g_local: it must hold values, not a declaration
            if self._claim_stale(layer, name):
                layer.g_local[name].zero_()
        if not self._uses_slots:
            return
        buf.barrier("reduce_grad:ready")
        for name in self.projections:
            self._path.reduce_into_owner(plan, layer.g_local[name], self.g_slots_all[name])
        buf.barrier("reduce_grad:read")
        for name in self.projections:
            self._path.zero_slots(plan, self.g_slots_all[name])
