"""Dense parameters at world size 1 without FSDP (parallel.dense=plain): FSDP2's mixed precision, bit for bit
(with optim.write_back_dense off).

At one rank FSDP2 shards nothing; what it does to the numbers is mixed precision, done here with a few
multi-tensor ops per pass instead of FSDP's per-parameter work and hooks (the optimizer aside, see below):

- the fp32 masters stay plain tensors registered on the model (what the optimizer, clipping, QK-Clip and
  checkpoints see between steps, as after FSDP at world 1, where the grads are fp32 too);
- the first forward after the masters were installed (a step's first pass, an evaluation) casts them into
  persistent compute-dtype copies with one torch._foreach_copy_ (round to nearest even, FSDP's
  `sharded.to(param_dtype)` before its all-gather) and registers the copies in their place; autograd then
  gives each copy its pass's grad in the compute dtype, as it gives FSDP's unsharded parameters. With
  optim.write_back_dense (the default on a GPU) the optimizer's fused pass writes the copies as it steps the
  masters (AdamW within a few fp32 ulps of torch's fused kernel, so no longer bit for bit FSDP's), and
  only masters changed since (QK-Clip, a load) are cast again;
- after each backward pass, accumulate_grads adds those grads into fp32 accumulators: the first pass a
  cast (one foreach copy), later passes a cast into a scratch buffer and one foreach add, which is FSDP's
  `unsharded_accumulated_grad += grad` (fp32 plus the exactly widened bf16 grad, rounded once), or on CUDA
  (plain_accumulate auto or triton) one launch of moontrain.parallel.grad_accumulate_kernel (the same values);
- reshard registers the masters again and hands over the accumulated grads (FSDP's reduce-scatter at
  world 1 is a copy: no division, reduce_dtype fp32), adding them to a grad the master still holds.

Two effects of FSDP's module hooks on the values are reproduced by the same hooks here, on the same
modules (each block and the root): the floating-point forward inputs are cast to the compute dtype
(MixedPrecisionPolicy.cast_forward_inputs: the rope tables arrive in fp32), and a block's inputs that
require grad pass through one identity autograd node (FSDP's RegisterPostBackwardFunction), which sets the
order in which their grads are summed in backward (the AttnRes partial sum is read by both of a layer's
aggregations; the completed blocks travel in a holder neither hook looks into, attn_res.CompletedBlocks). Inputs that need no grad are cast once per forward and reused by every block (same values, no
autograd node), where FSDP casts them again per block.

With the compute dtype equal to the masters' (fp32, the CPU default) nothing is copied: the masters run
and autograd accumulates their grads across passes in place, as it does FSDP's unsharded fp32 parameters.
parallel.fsdp_reshard_after_forward is moot (the copies are current from the first forward to the end of the
step; they and the fp32 accumulators stay allocated between steps); the expert masters are left alone, as
FSDP ignores them.

Memory, next to FSDP at world 1 with the blocks kept gathered: the same bf16 copies and fp32 grads, plus an
fp32 scratch from the second pass on, max(the largest dense tensor, 256 MiB), reused group by group.
Rejected: casts inside the autograd graph (one per parameter and pass); foreach adds of bf16 grads into
fp32 (mixed dtypes take the per-tensor path; a mixed-dtype foreach copy stays one multi-tensor kernel).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_flatten, tree_unflatten

from moontrain.model.transformer import K3Model
from moontrain.parallel.fsdp import expert_master_params

# The fp32 scratch the later passes' grads are widened into before their add: one flat buffer reused group by
# group (a whole copy of the dense grads would be 1.2 GiB at the DeepSeek-V3 benchmark point, held for the run)
SCRATCH_BYTES = 1 << 28


def _scratch_groups(numels: list[int], capacity: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) runs of tensors whose sizes fit `capacity` elements together (each tensor fits)."""
    groups, lo, used = [], 0, 0
    for i, n in enumerate(numels):
        if used + n > capacity and i > lo:
            groups.append((lo, i))
            lo, used = i, 0
        used += n
    if lo < len(numels):
        groups.append((lo, len(numels)))
    return groups


def _grad_accumulator(choice: str, device: torch.device) -> Any:
    """parallel.plain_accumulate = `choice` on `device`: a GradAccumulator (Triton), or None for the foreach ops."""
    on_cuda = device.type == "cuda"
    if choice == "torch" or (choice == "auto" and (not on_cuda or importlib.util.find_spec("triton") is None)):
        return None
    if importlib.util.find_spec("triton") is None:
        raise ValueError("parallel.plain_accumulate=triton needs triton (installed with torch's CUDA builds); "
                         "parallel.plain_accumulate=torch adds the grads with foreach ops")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"parallel.plain_accumulate=triton runs on a CUDA device (or in Triton's interpreter, "
                         f"TRITON_INTERPRET=1), the parameters are on {device}; parallel.plain_accumulate=auto "
                         "adds them with foreach ops there")
    from moontrain.parallel.grad_accumulate_kernel import GradAccumulator  # imports triton: only where it runs

    return GradAccumulator()


class _PassThrough(torch.autograd.Function):
    """Identity over a module's inputs that require grad: one autograd node, as FSDP's
    RegisterPostBackwardFunction, so that their grads are summed in FSDP's order."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class PlainDense:
    """The dense parameters of `model` (every parameter but the expert masters) at one rank: fp32 masters,
    compute_dtype copies for forward and backward, grads accumulated in fp32 (module docstring)."""

    def __init__(self, model: K3Model, compute_dtype: torch.dtype, accumulate: str = "torch") -> None:
        ignored = expert_master_params(model)
        slots: dict[int, list[tuple[nn.Module, str]]] = {}  # every registration of a master (shared ones too)
        masters: list[nn.Parameter] = []
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None or p in ignored:
                    continue
                if id(p) not in slots:
                    slots[id(p)] = []
                    masters.append(p)
                slots[id(p)].append((module, name))
        self.masters = masters
        self.slots = [slots[id(p)] for p in masters]
        self.compute_dtype = compute_dtype
        self.cast = any(p.dtype != compute_dtype for p in masters)
        self.compute = ([nn.Parameter(torch.empty_like(p, dtype=compute_dtype), requires_grad=p.requires_grad)
                         for p in masters] if self.cast else masters)
        self.acc: list[torch.Tensor] = [torch.empty_like(p) for p in masters] if self.cast else []
        self.scratch: torch.Tensor | None = None  # flat fp32, from the second pass of a step on (_scratch_groups)
        self._views: tuple[tuple[int, ...], list] | None = None  # _scratch_views's last groups and views
        # parallel.plain_accumulate: the later passes' adds in one Triton launch (None: the foreach ops)
        self.accumulator = _grad_accumulator(accumulate, masters[0].device) if self.cast and masters else None
        self.pending = [False] * len(masters)  # acc[i] holds this step's grad of masters[i]
        # masters[i]._version when compute[i] was last made equal to it (a cast, or the optimizer's write-back),
        # None once the master may have changed otherwise: an optimizer step that did not write it back (torch's
        # fused AdamW and foreach steps leave the version counters as they were), a load. A plain in-place op
        # after the write-back (QK-Clip, the mean-free router rows) moves the version: cast again too
        self.current: list[int | None] = [None] * len(masters)
        self.unsharded = False  # the compute copies are current and registered
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # this forward's casts of grad-free inputs
        self.root = model
        for module in (*model.layers, model):  # the modules FSDP wraps (moontrain.parallel.fsdp.apply_fsdp)
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module is self.root:
            self.unshard()
            self._casts.clear()
        args, kwargs = _apply_to_tensors(self._cast_input, (args, kwargs))
        if not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if idx:
            for i, x in zip(idx, _PassThrough.apply(*[flat[i] for i in idx]), strict=True):
                flat[i] = x
        return tree_unflatten(flat, spec)

    def _cast_input(self, x: torch.Tensor) -> torch.Tensor:
        """FSDP's _cast_fp_tensor; a grad-free input is cast once per forward (the same values every block)."""
        if not torch.is_floating_point(x) or x.dtype == self.compute_dtype:
            return x
        if x.requires_grad:
            return x.to(self.compute_dtype)
        hit = self._casts.get(id(x))
        if hit is None or hit[0] is not x or hit[0]._version != hit[2]:
            hit = (x, x.to(self.compute_dtype), x._version)
            self._casts[id(x)] = hit
        return hit[1]

    def _register(self, params: list[nn.Parameter]) -> None:
        for p, slots in zip(params, self.slots, strict=True):
            for module, name in slots:
                module._parameters[name] = p

    def write_back_targets(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(master, its compute copy, zero its grad) for the optimizer's fused write-back
        (moontrain.optim.write_back; optim.write_back_dense): the grads are the accumulators, which the next
        step's first pass overwrites, so they are not zeroed. Empty when nothing is cast."""
        return [(m, c, False) for m, c in zip(self.masters, self.compute, strict=True)] if self.cast else []

    def finish_step(self, written: frozenset[int]) -> None:
        """Right after an optimizer step: the masters it wrote back (ids) have current compute copies; every
        other master may have been stepped where its version counter does not show it, so it is cast again."""
        self.current = [m._version if id(m) in written else None for m in self.masters]

    def invalidate(self) -> None:
        """The masters changed where their version counters may not show it (a checkpoint load): cast them all
        at the next forward."""
        self.current = [None] * len(self.masters)

    def stale(self) -> list[int]:
        """The indices of the masters whose compute copies the next unshard casts."""
        return [i for i, m in enumerate(self.masters) if self.current[i] != m._version]

    @torch.no_grad()
    def unshard(self) -> None:
        """Cast the masters into the compute copies that are not current and register the copies (once until
        the next reshard)."""
        if self.unsharded:
            return
        if self.cast:
            stale = self.stale()
            if stale:
                torch._foreach_copy_([self.compute[i] for i in stale], [self.masters[i] for i in stale])
                for i in stale:
                    self.current[i] = self.masters[i]._version
            self._register(self.compute)
        self.unsharded = True

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """After a backward pass: its compute-dtype grads into the fp32 accumulators, which reshard hands to
        the masters (with compute dtype == fp32 autograd has accumulated them on the masters already)."""
        if not self.cast:
            return
        first_acc, first_grads, later, later_grads = [], [], [], []
        for i, c in enumerate(self.compute):
            g = c.grad
            if g is None:
                continue
            c.grad = None
            if self.pending[i]:
                later.append(i)
                later_grads.append(g)
                continue
            if self.masters[i].grad is self.acc[i]:  # handed over last step and not cleared: keep it
                self.acc[i] = torch.empty_like(self.acc[i])
            first_acc.append(self.acc[i])
            first_grads.append(g)
            self.pending[i] = True
        if first_acc:
            torch._foreach_copy_(first_acc, first_grads)
        if later:
            acc = [self.acc[i] for i in later]
            if self.accumulator is not None:
                self.accumulator.add_(acc, [g.contiguous() for g in later_grads])
                return
            for lo, hi, views in self._scratch_views(later):
                torch._foreach_copy_(views, later_grads[lo:hi])
                torch._foreach_add_(acc[lo:hi], views)

    def _scratch_views(self, later: list[int]) -> list[tuple[int, int, list[torch.Tensor]]]:
        """The scratch groups of the accumulators `later` indexes, each with its views of the scratch shaped
        as those accumulators: made once per set of parameters (every pass after a step's first has the same
        one), not per pass (a view per parameter and pass was most of the host's aten ops in this method)."""
        key = tuple(later)
        if self._views is not None and self._views[0] == key:
            return self._views[1]
        acc = [self.acc[i] for i in later]
        if self.scratch is None:
            biggest = max(a.numel() for a in self.acc)
            self.scratch = torch.empty(max(biggest, SCRATCH_BYTES // 4), dtype=self.acc[0].dtype,
                                       device=self.acc[0].device)
        groups = []
        for lo, hi in _scratch_groups([a.numel() for a in acc], self.scratch.numel()):
            views, offset = [], 0
            for a in acc[lo:hi]:
                views.append(self.scratch[offset: offset + a.numel()].view_as(a))
                offset += a.numel()
            groups.append((lo, hi, views))
        self._views = (key, groups)
        return groups

    @torch.no_grad()
    def reshard(self) -> None:
        """Register the masters again (after a step's last backward, an evaluation, before a checkpoint load)
        and give them the grads accumulated since the step's first pass."""
        if self.cast and self.unsharded:
            self._register(self.masters)
        self.unsharded = False
        for i in [i for i, pending in enumerate(self.pending) if pending]:
            m = self.masters[i]
            if m.grad is None:
                m.grad = self.acc[i]
            else:
                m.grad += self.acc[i]
            self.pending[i] = False
