"""Expert weights: one storage contract for every EP backend.

Legend: epn local experts on this rank, Hin/Hout a projection's input/output width, F the intermediate width.

Two projections: gate_up [H, 2F] (columns [0, F) W_gate, [F, 2F) W_up: one grouped GEMM each way, moonep.moe)
and down [F, H]. Per projection a MoE layer holds three tensors of shape [epn, Hin, Hout] for this rank's
local expert rows (global experts [ep_rank*epn, (ep_rank+1)*epn)):

- master (fp32 nn.Parameter): what the optimizer updates. Never used in forward, so FSDP ignores it
  (expert data parallelism is explicit, below); with the state sharded it holds this replica's rows.
- compute (compute dtype, bf16 on GPU): what the grouped GEMM reads. For `local`/`alltoall` it is a
  plain leaf tensor owned here; for `moonep` it is `layer.w_local[name]`, a view into moonep's
  symmetric memory (rows [E, E+B) of that memory are prefetch slots and are never seen here).
- grad (fp32): where weight gradients land. For `moonep` it is `layer.g_local[name]` (the fp32 grad
  mirror's local rows; moonep's reduce_grad folds slot-row grads in before we read it). For the
  other backends a post-accumulate hook on the compute leaf adds its .grad (upcast) here and frees it,
  so both paths present the same fp32 tensor to the trainer. Both accumulate loss_scale * grad
  (ExpertsContext.loss_scale, the loss-mean factor: no pass over the grads scales them afterwards).

Step protocol (trainer): backward -> reduce_grads over the expert-data-parallel group (local rows only)
-> attach_grads (master.grad = the master's rows of grad) -> clip, optimizer.step -> finish_step:
push_master (compute <- master) and zero the grads, or nothing for the projections a WriteBackAdamW step
already wrote back; moonep's grads are declared zero instead (its next accumulation overwrites them).
Rows of other ranks or slot rows never pass through any reduction issued here.

Sharded expert state (parallel.shard_expert_state, after shard_state): replica d of the D =
dp_replicate replicas owns rows [lo, lo + epn / D), lo = d * epn / D, of every projection, and its
master holds those rows only (the same Parameter object, its data replaced, so FSDP's ignored set and
the optimizer's groups still name it), so the fp32 master, the Adam moments and the optimizer step
cover 1/D of the experts. reduce_grads reduce-scatters the grads over the expert-data-parallel group in
place: the owner's rows of the whole grad buffer receive the sum over the replicas, the other rows are
left unreduced (never read; finish_step clears them). push_master writes the compute copy of the own
rows and all-gathers the compute rows over the group in place (compute dtype: bf16 on GPU). The compute
copy and the grad buffers stay whole (backward reads and accumulates every local row). Checkpoints store
the masters as canonical rows: a checkpoint loads at either setting (checkpoint.tensors.expert_shard_ownership).

Sharded == unsharded bitwise where the reduce-scatter and the all-reduce add the D contributions in
one order: always at D = 2, on gloo at D = 4 (tested); past D = 2 NCCL may pick a tree for one and a
ring for the other (last-bit differences). The grad norm sums per row block in both modes
(moontrain.parallel.clip) and AdamW is elementwise, so the shard's step equals the whole tensor's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moontrain.collectives import all_gather_single, reduce_scatter_single

PROJECTIONS = ("gate_up", "down")


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """The experts a model's MoE layers hold: rank ep_rank of an EP group of ep ranks holds the global experts
    [ep_rank * E / ep, (ep_rank + 1) * E / ep) of every layer. The default (0 of 1) holds them all."""

    ep_rank: int = 0
    ep: int = 1


class ExpertWeights(nn.Module):
    def __init__(self, *, num_experts: int, ep_rank: int, ep: int, hidden: int, intermediate: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if num_experts % ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel degree ep={ep}; "
                f"choose parallel.ep among the divisors of {num_experts}"
            )
        self.num_experts = num_experts
        self.num_local = num_experts // ep
        self.expert_offset = ep_rank * self.num_local
        self.shapes = {"gate_up": (hidden, 2 * intermediate), "down": (intermediate, hidden)}
        self.master = nn.ParameterDict({
            name: nn.Parameter(torch.empty(self.num_local, *shape, device=device, dtype=torch.float32))
            for name, shape in self.shapes.items()
        })
        self.compute: dict[str, torch.Tensor] = {}
        self.grad: dict[str, torch.Tensor] = {}
        self._defer_zero: Callable[[str], None] | None = None  # see bind_external
        self.sharded = False  # see shard_state
        self._shard_group: dist.ProcessGroup | None = None
        self._shard_size = 1
        self._shard_lo = 0

    @torch.no_grad()
    def shard_state(self, rank: int, size: int, group: dist.ProcessGroup | None) -> None:
        """Keep only rows [rank * epn / size, (rank + 1) * epn / size) of each master: the optimizer steps
        those, and the replicas of the group exchange the rest (module docstring)."""
        if self.num_local % size:
            raise ValueError(
                f"parallel.shard_expert_state=true splits the {self.num_local} local experts per EP rank over "
                f"dp_replicate={size} replicas, which does not divide them; choose parallel.ep so that "
                f"num_experts / ep is a multiple of dp_replicate = world / ep, or set parallel.shard_expert_state=false"
            )
        rows = self.num_local // size
        self.sharded, self._shard_group, self._shard_size, self._shard_lo = True, group, size, rank * rows
        for master in self.master.values():
            master.data = master.data[rank * rows:(rank + 1) * rows].clone()

    @property
    def intermediate(self) -> int:
        """F: gate_up's columns [0, F) are W_gate, [F, 2F) W_up."""
        return self.shapes["down"][0]

    def column_blocks(self) -> dict[str, tuple[int, ...]]:
        """Per-matrix Muon: parameter name -> the column widths of the separate matrices in each expert's
        [Hin, Hout] (gate_up: W_gate and W_up); a projection not named is one matrix."""
        return {"master.gate_up": (self.intermediate, self.intermediate)}

    @property
    def master_rows(self) -> tuple[int, int]:
        """(first local row, rows) the masters hold: (0, epn), or this replica's shard."""
        return self._shard_lo, next(iter(self.master.values())).shape[0]

    @torch.no_grad()
    def init_master(self, *, seed: int, layer_idx: int, stds: dict[str, float]) -> None:
        """N(0, std^2) per matrix: W_gate, W_up and down at stds["gate"], stds["up"] and stds["down"]
        (moontrain.model.init.expert_stds), each global expert's matrix from its own generator (streams 0, 1,
        2), so the values depend on neither the EP layout nor the storage: a matrix is drawn into a contiguous
        block (normal_ fills in memory order), then copied into its columns."""
        F, H = self.shapes["down"]
        matrices = (("gate_up", 0, F, "gate"), ("gate_up", F, 2 * F, "up"), ("down", 0, H, "down"))
        for proj_idx, (name, lo, hi, matrix) in enumerate(matrices):
            master = self.master[name]
            block = torch.empty(master.shape[1], hi - lo, device=master.device, dtype=master.dtype)
            for j in range(master.shape[0]):
                e = self.expert_offset + self._shard_lo + j
                gen = torch.Generator(device=master.device)
                gen.manual_seed(((seed * 1009 + layer_idx) * 3 + proj_idx) * 1_000_003 + e)
                master[j, :, lo:hi] = block.normal_(0.0, stds[matrix], generator=gen)

    def bind_owned(self, dtype: torch.dtype, loss_scale: float) -> None:
        """local/alltoall: own the compute leaves and an fp32 grad buffer that a hook fills with
        loss_scale * the compute leaf's grad."""
        for name, master in self.master.items():
            shape = (self.num_local, *self.shapes[name])  # every local row, whether or not the master is sharded
            compute = torch.empty(shape, dtype=dtype, device=master.device, requires_grad=True)
            grad = torch.zeros(shape, dtype=torch.float32, device=master.device)
            compute.register_post_accumulate_grad_hook(_make_fold_hook(grad, float(loss_scale)))
            self.compute[name], self.grad[name] = compute, grad
        self.push_master()

    def bind_external(self, compute: dict[str, torch.Tensor], grad: dict[str, torch.Tensor],
                      defer_zero: Callable[[str], None] | None = None) -> None:
        """moonep: compute and grad are views into memory the EP library owns. `defer_zero(name)`, when
        given, declares grad[name] zero without writing it (the library's next accumulation overwrites
        it; see moonep.ExpertPools.defer_zero_grads): finish_step then never zeroes these grads."""
        for name in self.master:
            shape = (self.num_local, *self.shapes[name])
            if tuple(compute[name].shape) != shape or tuple(grad[name].shape) != shape:
                raise ValueError(
                    f"expert projection {name!r}: backend views {tuple(compute[name].shape)} / "
                    f"{tuple(grad[name].shape)} do not match the local rows' shape {shape}"
                )
            if grad[name].dtype != torch.float32:
                raise ValueError(f"expert projection {name!r}: grad view must be float32, got {grad[name].dtype}")
        self.compute, self.grad = dict(compute), dict(grad)
        self._defer_zero = defer_zero
        self.push_master()

    @torch.no_grad()
    def push_master(self, whole: dict[str, torch.Tensor] | None = None) -> None:
        """compute <- master for every projection (collective over the replicas when sharded), or, given
        `whole` (projection -> this EP rank's epn canonical rows), compute <- whole without a collective."""
        for name in self.master:
            if whole is not None:
                self.compute[name].copy_(whole[name])
            else:
                self._push(name)

    def _push(self, name: str) -> None:
        lo, rows = self.master_rows
        compute = self.compute[name]
        compute[lo:lo + rows].copy_(self.master[name])
        if self._shard_size > 1:  # in place: the input is the output's own block (NCCL runs it in place)
            all_gather_single(compute, compute[lo:lo + rows], group=self._shard_group)

    @torch.no_grad()
    def reduce_grads(self, group: dist.ProcessGroup | None) -> None:
        """Sum this rank's local-row grads over the expert-data-parallel group (they carry the loss
        scale already): all of them, or, with the state sharded, only this replica's rows (an in-place
        reduce-scatter: the output is the input's own block, which NCCL runs in place)."""
        if group is None or dist.get_world_size(group) == 1:
            return
        lo, rows = self.master_rows
        for name in PROJECTIONS:
            grad = self.grad[name]
            if self.sharded:
                reduce_scatter_single(grad[lo:lo + rows], grad, op=dist.ReduceOp.SUM, group=group)
            else:
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)

    def attach_grads(self) -> None:
        """master.grad = the master's rows of the reduced grad (all local rows, or the shard's)."""
        lo, rows = self.master_rows
        for name, master in self.master.items():
            master.grad = self.grad[name][lo:lo + rows] if self.sharded else self.grad[name]

    @property
    def defers_zero(self) -> bool:
        """True when the backend clears the grads itself on their next accumulation (moonep)."""
        return self._defer_zero is not None

    @torch.no_grad()
    def finish_step(self, written: set[int] | frozenset[int] = frozenset()) -> None:
        """After optimizer.step: push_master and zero the grads, except for the projections whose
        master's id is in `written` (WriteBackAdamW's fused step already wrote their compute rows, and
        zeroed their grads unless the backend defers zeroing). With a deferring backend the grads are
        declared zero instead of written."""
        for name, master in self.master.items():
            if id(master) not in written:
                self._push(name)
                if self._defer_zero is None:
                    self.grad[name].zero_()
            if self._defer_zero is not None:
                self._defer_zero(name)
            master.grad = None


def _make_fold_hook(grad_fp32: torch.Tensor, scale: float):
    # the grad and the scale, never the module: the hook lives on the compute tensor (C++), which the
    # module holds, and a reference back to the module would be a cycle Python's collector cannot see
    # (no trainer would ever be freed)
    def fold(leaf: torch.Tensor) -> None:
        grad_fp32.add_(leaf.grad, alpha=scale)
        leaf.grad = None

    return fold
