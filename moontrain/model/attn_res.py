"""Block Attention Residuals (AttnRes, Kimi Team, arXiv 2603.15031): each sub-layer's input is a softmax
attention over depth instead of the running residual sum.

Legend: N values attended over, B batch, T sequence, D hidden.

Values: the completed block representations b_0 .. b_{n-1} (b_0 is the token embedding) and the partial
sum of the current block (the outputs of its sub-layers so far). Keys: RMSNorm(v) with a learned weight
g; the query is a learned pseudo-query w per aggregation (zero at init: uniform weights), not a function
of the token:

    h = sum_n softmax_n(w . RMSNorm(v_n)) v_n      w . RMSNorm(v_n) = (v_n . (w * g)) * rsqrt(mean(v_n^2) + eps)

Block structure (model.attn_res_block_size S sub-layers per block, attention and FFN counting one each):
transformer layer i starts a block when i % (S / 2) == 0, committing the partial sum it receives (the
embedding at layer 0) as a completed block before its attention runs; the attention's and the FFN's
inputs are aggregations (one DepthAttention each); their outputs are added to the partial sum; after
the last layer one more aggregation feeds the final norm. K3: S = 12 (6 transformer layers per block).

Numerics and memory: DepthAttention is one autograd function. It upcasts each value to fp32 on the fly,
accumulates h in fp32 and rounds it once to the values' dtype, and saves only references to its inputs plus
two [N, B, T] fp32 tensors (the rsqrt factors and the weights); backward recomputes the rest one value at a
time (autograd through the formula would save an fp32 copy of every value per aggregation). The pseudo-query
and the key-norm weight enter the op as they are (FSDP's bf16 copies): their fp32 product and the product
rule's gradients are made inside the math, so train.compile fuses them (seven eager casts and multiplies per
call otherwise).

Activation checkpointing: a block's recompute re-runs its two aggregations from the same tuple of
completed blocks (tuples: never mutated after a layer read them) and the partial sum it received; the
completed blocks are partial sums some layer received, which the checkpoints hold anyway, so AttnRes
adds two [N, B, T] fp32 tensors per aggregation in backward and nothing between forward and backward.
Gradient sums: a completed block is read by every later aggregation; complete_block marks it with a
BlockGrad into which their backwards add its gradient in place (the kernels in their store), and its node
hands the sum on after the last of them. A partial sum's readers, an aggregation and residual_add, meet the
same way: the add's backward leaves its gradient in a ResidualGrad for the aggregation's to add to (autograd
adds each pair in a kernel of its own). The blocks travel between layers in CompletedBlocks, which FSDP's
and parallel.dense=plain's module hooks do not look into (their identity nodes would hide the BlockGrad).
FSDP: the queries and key-norm weights are dense parameters of their block (the final one of the root's).

Kernels (kernels.attn_res): the math above in PyTorch (compiled with train.compile), or in Triton
(moontrain.model.attn_res_kernel: each value read about once per walk over D; docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from moontrain.model.kernel_choice import runs_cuda_kernels
from moontrain.model.norm import RMSNorm


def aggregate_forward(q: torch.Tensor, eps: float, values: tuple[torch.Tensor, ...]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The aggregation in fp32 (q: the query times the key-norm weight, fp32): (h in the values' dtype,
    rsqrt factors [N, B, T], weights [N, B, T]). Per value one pass over D for both row reductions
    (mean square and the dot with q, written as a product and a sum so that a compiler fuses them), then
    one weighted sum over all values."""
    rs, logits = [], []
    for v in values:
        vf = v.to(q.dtype)
        r = torch.rsqrt(vf.pow(2).mean(-1) + eps)
        rs.append(r)
        logits.append((vf * q).sum(-1) * r)
    p_NBT = torch.softmax(torch.stack(logits), dim=0)
    h = p_NBT[0].unsqueeze(-1) * values[0].to(q.dtype)
    for p, v in zip(p_NBT[1:], values[1:], strict=True):
        h = h + p.unsqueeze(-1) * v.to(q.dtype)
    return h.to(values[0].dtype), torch.stack(rs), p_NBT


def aggregate_backward(q: torch.Tensor, r_NBT: torch.Tensor, p_NBT: torch.Tensor, grad_h: torch.Tensor,
                       values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gradients of aggregate_forward's h with respect to q and every value; the logits' dot products are
    recomputed (one pass over each value for them and the weights' gradient)."""
    gh = grad_h.to(q.dtype)
    dim = q.shape[0]
    grad_p, dots = [], []
    for v in values:
        vf = v.to(q.dtype)
        grad_p.append((gh * vf).sum(-1))
        dots.append((vf * q).sum(-1))
    grad_p_NBT = torch.stack(grad_p)
    grad_logit = p_NBT * (grad_p_NBT - (p_NBT * grad_p_NBT).sum(0, keepdim=True))
    grad_q = torch.zeros_like(q)
    grad_values = []
    for v, s, r, p, gl in zip(values, dots, r_NBT, p_NBT, grad_logit, strict=True):
        vf = v.to(q.dtype)
        # logit = (v . q) r, r = rsqrt(mean(v^2) + eps): d logit / dv = r q - (v . q) r^3 v / D
        gv = gh * p.unsqueeze(-1) + (gl * r).unsqueeze(-1) * q - (gl * s * r.pow(3) / dim).unsqueeze(-1) * vf
        grad_values.append(gv.to(v.dtype))
        grad_q = grad_q + ((gl * r).unsqueeze(-1) * vf).flatten(0, -2).sum(0)
    return grad_q, grad_values


def depth_forward(query: torch.Tensor, key_weight: torch.Tensor, eps: float, values: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aggregate_forward with its q = query * key-norm weight (both upcast to fp32) made here, inside
    what train.compile fuses: the parameters arrive in their own dtype (FSDP's bf16 copies)."""
    dtype = torch.promote_types(values[0].dtype, torch.float32)
    return aggregate_forward(query.to(dtype) * key_weight.to(dtype), eps, values)


def depth_backward(query: torch.Tensor, key_weight: torch.Tensor, r_NBT: torch.Tensor, p_NBT: torch.Tensor,
                   grad_h: torch.Tensor, values: tuple[torch.Tensor, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of depth_forward's h with respect to the query, the key-norm weight and every value;
    the parameters' gradients are the product rule's, rounded once to their dtype."""
    qf, wf = query.to(r_NBT.dtype), key_weight.to(r_NBT.dtype)
    grad_q, grad_values = aggregate_backward(qf * wf, r_NBT, p_NBT, grad_h, values)
    return (grad_q * wf).to(query.dtype), (grad_q * qf).to(key_weight.dtype), grad_values


def summing_into(backward: Callable) -> Callable:
    """depth_backward's signature plus `into` (per value: None, or the gradient summed so far that the
    value's gradient is added to, in place): the PyTorch math's form of the kernels' summing store."""

    def run(query: torch.Tensor, key_weight: torch.Tensor, r_NBT: torch.Tensor, p_NBT: torch.Tensor,
            grad_h: torch.Tensor, values: tuple[torch.Tensor, ...], into: list[torch.Tensor | None] | None = None):
        grad_query, grad_weight, grad_values = backward(query, key_weight, r_NBT, p_NBT, grad_h, values)
        into = into if into is not None else [None] * len(values)
        return grad_query, grad_weight, [g if t is None else t.add_(g)
                                         for g, t in zip(grad_values, into, strict=True)]

    return run


EAGER = (depth_forward, summing_into(depth_backward))


@functools.cache
def compiled_math() -> tuple[Callable, Callable]:
    """depth_forward and depth_backward through torch.compile (one graph per number of values: at most
    num_layers / (block_size / 2) + 2 of them, so the recompile limit is raised to hold them all)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return (torch.compile(depth_forward, dynamic=False),
            summing_into(torch.compile(depth_backward, dynamic=False)))


@functools.cache
def triton_math() -> tuple[Callable, Callable]:
    """depth_forward and depth_backward as Triton kernels (moontrain.model.attn_res_kernel); an aggregation
    over more values than the kernels take runs the functions above."""
    from moontrain.model import attn_res_kernel as k  # imports triton: only where it runs

    def forward(query: torch.Tensor, key_weight: torch.Tensor, eps: float, values: tuple[torch.Tensor, ...]):
        fn = k.depth_forward if len(values) <= k.MAX_VALUES else depth_forward
        return fn(query, key_weight, eps, values)

    spec_backward = summing_into(depth_backward)

    def backward(query: torch.Tensor, key_weight: torch.Tensor, r_NBT: torch.Tensor, p_NBT: torch.Tensor,
                 grad_h: torch.Tensor, values: tuple[torch.Tensor, ...],
                 into: list[torch.Tensor | None] | None = None):
        fn = k.depth_backward if len(values) <= k.MAX_VALUES else spec_backward
        return fn(query, key_weight, r_NBT, p_NBT, grad_h, values, into)

    return forward, backward


def uses_triton(choice: str, device: torch.device | str | None) -> bool:
    """Whether kernels.attn_res = `choice` (auto, torch or triton) runs the Triton kernels on `device`."""
    return runs_cuda_kernels("attn_res", choice, device, "the PyTorch math")


class BlockGrad:
    """The gradient of one completed block, summed here by the aggregations that read the block (every later
    aggregation) instead of by autograd: autograd would take each aggregation's gradient of the
    block as a new tensor and add it to the sum in a separate kernel; the aggregations' backward adds it in
    place (the Triton kernel in its store). complete_block's node hands the sum on once all of them ran."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        grad, self.grad = self.grad, None
        return grad


class _CompletedBlock(torch.autograd.Function):
    """Identity whose backward returns the block's BlockGrad sum: the aggregations reading the block return
    None for it and depend on this node, so autograd runs it after all of them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sink: BlockGrad) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # the readers return None: no zeros made for them
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        total = ctx.sink.take()
        if grad is not None:  # a reader that is not an aggregation
            total = grad if total is None else total + grad
        return total, None


def complete_block(x: torch.Tensor) -> torch.Tensor:
    """x (a partial sum) as a completed block: a tensor carrying the BlockGrad its readers sum into; x itself
    where no gradient is taken (evaluation, decoding)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    sink = BlockGrad()
    block = _CompletedBlock.apply(x, sink)
    block.attn_res_grad = sink
    return block


class ResidualGrad(BlockGrad):
    """The gradient the residual add (residual_add) hands the aggregation that read the same partial sum: that
    aggregation's backward adds its own gradient of the partial sum to it (in place, as into a BlockGrad) and
    returns the sum, where autograd would add the two in a separate kernel. The add's node is downstream of the
    aggregation's (its other input is computed from the aggregation's output), so it always runs first."""

    __slots__ = ()


class _ResidualAdd(torch.autograd.Function):
    """partial + out; backward leaves the partial sum's gradient in the ResidualGrad for its aggregation."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, out: torch.Tensor, sink: ResidualGrad) -> torch.Tensor:
        ctx.sink = sink
        return partial + out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sink.grad = grad
        return None, grad, None


def residual_grad(partial: torch.Tensor) -> ResidualGrad | None:
    """The slot through which residual_add hands the partial sum's gradient to the aggregation that reads the
    same partial sum (pass it to both); None where no gradient is taken."""
    return ResidualGrad() if torch.is_grad_enabled() and partial.requires_grad else None


def residual_add(partial: torch.Tensor, out: torch.Tensor, sink: ResidualGrad | None) -> torch.Tensor:
    """partial + out, the partial sum's gradient left in `sink` (from residual_grad: the aggregation that read
    `partial` with this sink adds its own to it); a plain add where sink is None."""
    return partial + out if sink is None else _ResidualAdd.apply(partial, out, sink)


class CompletedBlocks:
    """The completed blocks a transformer layer receives and passes on, in a holder that module hooks do not look
    into (neither FSDP's nor parallel.dense=plain's pre-forward hooks traverse it). Those hooks route every tensor
    input that needs grad through one identity autograd node per layer: each layer's readers would get a new
    tensor without the block's BlockGrad, and autograd would sum their gradients again. The blocks are the
    model's own activations in the compute dtype already, so the hooks' input casts have nothing to do on them."""

    __slots__ = ("values",)

    def __init__(self, values: tuple[torch.Tensor, ...] = ()) -> None:
        self.values = values


class _DepthAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: torch.Tensor, key_weight: torch.Tensor, eps: float, math: tuple[Callable, Callable],
                residual: ResidualGrad | None, *values: torch.Tensor) -> torch.Tensor:
        h, r_NBT, p_NBT = math[0](query, key_weight, eps, values)
        ctx.save_for_backward(query, key_weight, r_NBT, p_NBT, *values)
        ctx.backward_math = math[1]
        # the sinks of this forward: backward uses this ctx (a checkpoint's recompute makes another and drops it)
        ctx.sinks = [getattr(v, "attn_res_grad", None) for v in values]
        if residual is not None and ctx.sinks[-1] is not None:
            raise ValueError("an AttnRes aggregation's last value is a completed block and a partial sum at once: "
                             "pass a residual sink only with the partial sum the residual add reads")
        ctx.residual = residual
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        query, key_weight, r_NBT, p_NBT, *values = ctx.saved_tensors
        into = [None if s is None else s.grad for s in ctx.sinks]
        residual = ctx.residual.take() if ctx.residual is not None else None
        if residual is not None and _summable(residual, values[-1]):
            into[-1], residual = residual, None  # the math adds the partial sum's gradient to it in place
        grad_query, grad_weight, grad_values = ctx.backward_math(query, key_weight, r_NBT, p_NBT, grad_h,
                                                                 tuple(values), into)
        if residual is not None:  # a gradient in another layout or dtype: summed here
            grad_values[-1] = grad_values[-1] + residual
        for sink, grad in zip(ctx.sinks, grad_values, strict=True):
            if sink is not None:
                sink.grad = grad
        return grad_query, grad_weight, None, None, None, *(None if s is not None else g
                                                            for s, g in zip(ctx.sinks, grad_values, strict=True))


def _summable(grad: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the backward math can add a value's gradient into `grad` in place (its kernels need this)."""
    return grad.shape == value.shape and grad.dtype == value.dtype and grad.is_contiguous()


class DepthAttention(nn.Module):
    """One AttnRes aggregation: a zero-initialised pseudo-query and the keys' RMSNorm weight."""

    def __init__(self, dim: int, eps: float = 1e-6, device: torch.device | str | None = None,
                 kernel: str = "torch") -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim, device=device))
        self.key_norm = RMSNorm(dim, eps, device=device)  # only its weight and eps are used
        self.math = triton_math() if uses_triton(kernel, device) else EAGER

    def compile_math(self) -> None:
        """Run the aggregation's PyTorch math through torch.compile (train.compile); the Triton kernels stay."""
        if self.math is EAGER:
            self.math = compiled_math()

    def forward(self, blocks: tuple[torch.Tensor, ...], partial: torch.Tensor | None = None,
                residual: ResidualGrad | None = None) -> torch.Tensor:
        """softmax-weighted sum of (*blocks, partial), each [B, T, D] (no partial: of the blocks alone). residual:
        the partial sum's ResidualGrad where residual_add also reads it (residual_grad)."""
        values = blocks if partial is None else (*blocks, partial)
        if residual is not None and partial is None:
            raise ValueError("DepthAttention: a residual sink belongs to a partial sum; none was given")
        return _DepthAttention.apply(self.query, self.key_norm.weight, self.key_norm.eps, self.math, residual,
                                     *values)


def aggregation_sizes(num_layers: int, block_size: int) -> list[int]:
    """The number of values N each aggregation attends over, in forward order: two per layer (before
    the attention, before the FFN), then the final one. Empty for standard residuals (block_size 0)."""
    if not block_size:
        return []
    sizes, completed = [], 0
    for layer_idx in range(num_layers):
        sizes.append(completed + 1)
        completed += starts_block(layer_idx, block_size)
        sizes.append(completed + 1)
    return [*sizes, completed + 1]


def starts_block(layer_idx: int, block_size: int) -> bool:
    """Whether transformer layer layer_idx commits the partial sum as a completed block (block_size in
    sub-layers, two per transformer layer)."""
    return layer_idx % (block_size // 2) == 0
