"""expert_glu: the routed-expert half of an MoE layer on moonep, as one autograd op.

forward:  plan -> prefetch (side stream, overlapping the dispatch of token rows) -> dispatch ->
          hu = x W_gate_up = [x W_gate | x W_up] (one grouped GEMM over W_compact), a = f(h, u) on hu's
          halves (the path's gate_up: one fused kernel with BufferOptions.fused_expert_gemm) ->
          o = a W_down -> y_rows = o * route weight -> combine (with BufferOptions.combine_reduce
          "destination": combine takes o and the route weights and multiplies in fp32 as it sums)
backward: re-prefetch if another layer used the slots (side stream) -> dispatch(grad_y) with the
          saved plan -> g = gy W_down^T, then grad_hu = grad_h | grad_u, the route-weight grads and
          a_w = w * a in one elementwise pass (the path's glu_route_backward) -> W_down's grad (a_w^T gy)
          -> grads of rows grad_hu W_gate_up^T (one GEMM of K = 2F; the last read of the slots; then the
          previous layer's copies start on the side stream, ExpertPools.previous_forward) -> dispatch(x)
          again into the receive rows -> W_gate_up's grad x^T grad_hu (fp32 into the grad mirror: local
          rows accumulate into g_local, slot rows into the reduce pool) -> combine(grad_x_rows) with the
          route-weight grads gathered per (token, k) ->
          reduce_grad on the communication stream (it overlaps the backward upstream, e.g.
          attention, until the next moonep call joins it; Buffer.wait_pending before the grads
          are read)

Saved for backward: x_sH [s, H] (the caller keeps it for its own backward anyway: the router's input),
the route weights per row, hu [S*K, 2F]. Not saved: the dispatched rows of x and the expert output o
(each [S*K, H]): x's rows are dispatched again (a local copy at one rank, the forward dispatch's traffic
at more), o is not needed. At the DeepSeek-V3 benchmark point (H 2048, F 1024, 32k tokens per pass) that
is 2 of 3 GiB per layer and pass.

Gate and up are one projection, W_gate_up [E+B, H, 2F] in the heap (glu_projections): its column halves
are W_gate and W_up, so the forward is one grouped GEMM of N = 2F and the input gradient one of K = 2F
(two of N = F and two of K = F summed cost 1.14x / 1.38x more at k3_small's F = 896: docs/performance.md).

The gated activation f is a parameter of the op, by name (moonep.activation: "swiglu", ...). The
elementwise steps (f, its backward with the route weights, the forward's route-weight scale) run on the
buffer's data path (moonep.datapath): the PyTorch specification or its Triton kernels.

Legend: s tokens, K top-k, H hidden (buffer width), F expert FFN width, G = epn + B groups.
"""

from __future__ import annotations

import torch

from moonep.activation import get_activation
from moonep.buffer import Buffer
from moonep.pools import ExpertPools, LayerExperts

PROJECTIONS = ("gate_up", "down")


def glu_projections(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """The projection shapes `expert_glu` expects in ExpertPools: gate_up [H, 2F] holds W_gate in its columns
    [0, F) and W_up in [F, 2F) (moonep.split_gate_up), down [F, H]."""
    return {"gate_up": (hidden, 2 * ffn), "down": (ffn, hidden)}


def split_gate_up(w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_gate, W_up): the column halves of a merged gate_up weight [..., H, 2F] (views)."""
    if w_gate_up.shape[-1] % 2:
        raise ValueError(f"a gate_up weight has an even last dimension 2F, got shape {tuple(w_gate_up.shape)}")
    return w_gate_up.chunk(2, dim=-1)


def merge_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The merged gate_up weight [..., H, 2F] of W_gate and W_up [..., H, F] (a new tensor)."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate and up weights of one shape, got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    return torch.cat([w_gate, w_up], dim=-1)


class _ExpertGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sH, weights_sK, topk_sK, tokens_per_expert_E, buffer: Buffer, layer: LayerExperts,
                activation: str, track: bool):
        plan = buffer.plan(topk_sK, tokens_per_expert_E)
        ctx.prev = layer.pools.previous_forward(layer, plan, track)
        layer.pools.prefetch_async(plan, layer)  # expert copies overlap the token rows' dispatch
        res = buffer.dispatch(x_sH, weights_sK, plan=plan)
        offs = res.cu_seqlens
        # the receive rows are reused by the next dispatch: backward dispatches x_sH again rather than
        # keeping a copy of its rows ([S*K, H], the op's largest saved tensor). The route weights'
        # copy is small and kept.
        w_rows = res.weights_rows.clone()
        layer.pools.wait_prefetch()
        w = layer.w_compact
        path = buffer.path
        a, hu = path.gate_up(activation, res.x_rows, w["gate_up"], offs)
        o = path.grouped_mm(a, w["down"], offs)
        del a  # not saved: backward recomputes it from hu
        if _fused_combine(buffer):  # the fp32 product summed as it is, no rounding, no pass of its own
            y_sH, _ = buffer.combine(plan, o, row_weights=w_rows)
        else:
            y_in = buffer.combine_input(plan)
            path.scale_rows(o, w_rows, y_in)  # fp32 product, rounded once into the symmetric rows
            y_sH, _ = buffer.combine(plan, y_in)
        # o is not saved either: the route weights' grads come from g = gy W_down^T and a (glu_route_backward)
        ctx.save_for_backward(x_sH, w_rows, hu)
        ctx.plan, ctx.buffer, ctx.layer, ctx.activation = plan, buffer, layer, activation
        ctx.wgrad_scale = layer.pools.wgrad_scale  # as configured for this forward
        ctx.weights_dtype = weights_sK.dtype
        return y_sH

    @staticmethod
    def backward(ctx, grad_y_sH):
        x_sH, w_rows, hu = ctx.saved_tensors
        plan, buffer, layer = ctx.plan, ctx.buffer, ctx.layer
        offs = plan.cu_seqlens
        layer.pools.ensure_async(plan, layer)  # re-prefetch (another layer used the slots) overlaps dispatch
        gy = buffer.dispatch(grad_y_sH.contiguous(), plan=plan).x_rows
        path = buffer.path
        layer.pools.wait_prefetch()
        w = layer.w_compact
        g = path.grouped_mm(gy, w["down"].transpose(1, 2), offs)  # dL/da without the route weight
        grad_hu, a_w, grad_w_rows = path.glu_route_backward(ctx.activation, g, hu, w_rows)
        del g
        pools = layer.pools
        pools.accumulate_wgrad(layer, "down", a_w, gy, offs, ctx.wgrad_scale)  # gy's last reader
        del a_w, gy
        if not pools.uses_slots:  # one rank: the weight grad (and its bf16 temporary) before the dgrad's output exists
            ctx.prev = None  # no slot to refill
            _gate_up_weight_grad(ctx, x_sH, grad_hu)
        grad_x_rows = path.grouped_mm(grad_hu, w["gate_up"].transpose(1, 2), offs)
        if pools.uses_slots:  # the dgrad was the slots' last reader: the previous layer's copies overlap the wgrad
            if ctx.prev is not None:
                prev_layer, prev_plan = ctx.prev
                ctx.prev = None  # once (a retained graph's second backward just prefetches as usual)
                pools.prefetch_async(prev_plan, prev_layer)
            _gate_up_weight_grad(ctx, x_sH, grad_hu)
        del grad_hu
        grad_x_sH, grad_weights_sK = buffer.combine(plan, grad_x_rows, row_scalars=grad_w_rows)
        buffer.reduce_grad_async(plan, layer)
        return grad_x_sH, grad_weights_sK.to(ctx.weights_dtype), None, None, None, None, None, None


def _gate_up_weight_grad(ctx, x_sH: torch.Tensor, grad_hu: torch.Tensor) -> None:
    """W_gate_up's grad: x's rows dispatched again with the saved plan, into the receive rows gy occupied
    (dispatch's "dispatch:enter" barrier orders a peer's writes after every rank's reads of gy)."""
    x_rows = ctx.buffer.dispatch(x_sH, plan=ctx.plan).x_rows
    ctx.layer.pools.accumulate_wgrad(ctx.layer, "gate_up", x_rows, grad_hu, ctx.plan.cu_seqlens, ctx.wgrad_scale)


def _fused_combine(buffer: Buffer) -> bool:
    """Combine scales by the route weights (forward) itself: when the buffer's data path sums at the
    destination (its combine_reduce), the switch of the whole fp32 combine order."""
    return buffer.path.combine_reduce == "destination"


def expert_glu(buffer: Buffer, pools: ExpertPools, layer: LayerExperts, x_sH: torch.Tensor,
               weights_sK: torch.Tensor, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor | None = None,
               *, activation: str = "swiglu") -> torch.Tensor:
    """Routed gated-FFN experts of one MoE layer: y[t] = sum_k w[t,k] * expert_{topk[t,k]}(x[t]) with
    expert_e(x) = f(x W_gate[e], x W_up[e]) W_down[e] and f the registered `activation`
    (moonep.activation).

    Differentiable in x_sH and weights_sK; expert weight grads accumulate (fp32) into
    `layer.g_local` after reduce_grad, which backward leaves queued on the buffer's communication
    stream: call `buffer.wait_pending()` before reading them (any later call on the buffer also
    orders after it). Collective: every rank of the buffer's group calls it."""
    if layer.pools is not pools or pools.buffer is not buffer:
        raise ValueError("layer does not belong to these pools/buffer; pass the objects it was created from")
    missing = [p for p in PROJECTIONS if p not in pools.projections]
    if missing:
        raise ValueError(f"expert_glu needs projections {PROJECTIONS}, pools lack {missing}; build them with "
                         "moonep.glu_projections(H, F)")
    get_activation(activation)
    track = torch.is_grad_enabled() and (x_sH.requires_grad or weights_sK.requires_grad)
    return _ExpertGLU.apply(x_sH, weights_sK, topk_sK, tokens_per_expert_E, buffer, layer, activation, track)
