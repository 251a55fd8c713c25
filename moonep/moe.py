"""expert_swiglu: the routed-expert half of an MoE layer on moonep, as one autograd op.

forward:  plan -> prefetch (side stream, overlapping the dispatch of token rows) -> dispatch ->
          h = x W_gate, u = x W_up (grouped over W_compact) ->
          o = (silu(h) * u) W_down -> y_rows = o * route weight -> combine
backward: re-prefetch if another layer used the slots (side stream) -> dispatch(grad_y) with the
          saved plan -> grads of rows (the last read of the slots; then the previous layer's
          copies start on the side stream, ExpertPools.previous_forward) -> weight grads (fp32
          into the grad mirror: local rows accumulate into g_local, slot rows into the reduce
          pool) -> combine(grad_x_rows) with the route-weight grads gathered per (token, k) ->
          reduce_grad on the communication stream (it overlaps the backward upstream, e.g.
          attention, until the next moonep call joins it; Buffer.wait_pending before the grads
          are read)

Legend: s tokens, K top-k, H hidden (buffer width), F expert FFN width, G = epn + B groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moonep.buffer import Buffer
from moonep.grouped_gemm import grouped_mm
from moonep.pools import ExpertPools, LayerExperts

PROJECTIONS = ("gate", "up", "down")


def swiglu_projections(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """The projection shapes `expert_swiglu` expects in ExpertPools."""
    return {"gate": (hidden, ffn), "up": (hidden, ffn), "down": (ffn, hidden)}


def swiglu_backward_torch(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a = silu(h) * u: (grad_h, grad_u, a) from grad_a, in fp32 with one rounding to h's dtype
    (the specification of moonep.kernels.swiglu)."""
    hf = h.float()
    sig = torch.sigmoid(hf)
    ga = grad_a.float()
    grad_h = (ga * u.float() * sig * (1 + hf * (1 - sig))).to(h.dtype)
    grad_u = (ga * (hf * sig)).to(h.dtype)
    return grad_h, grad_u, F.silu(h) * u


def route_backward_torch(gy: torch.Tensor, o: torch.Tensor, w_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For y_rows = o * w (per row): (grad_o, grad_w) from gy; fp32 products, grad_o rounded once to gy's
    dtype (the specification of moonep.kernels.route_weights.route_backward)."""
    grad_w = (gy.float() * o).sum(-1)
    grad_o = torch.mul(gy, w_rows[:, None], out=torch.empty_like(gy))
    return grad_o, grad_w


class _ExpertSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sH, weights_sK, topk_sK, tokens_per_expert_E, buffer: Buffer, layer: LayerExperts,
                track: bool):
        plan = buffer.plan(topk_sK, tokens_per_expert_E)
        ctx.prev = layer.pools.previous_forward(layer, plan, track)
        layer.pools.prefetch_async(plan, layer)  # expert copies overlap the token rows' dispatch
        res = buffer.dispatch(x_sH, weights_sK, plan=plan)
        offs = res.cu_seqlens
        # the receive rows are reused by the next dispatch: backward's copy is made on the side stream
        # while the gate/up GEMMs read the receive rows themselves; joined before combine, whose
        # barriers are what let a peer's next dispatch write the receive rows again
        x_rows = layer.pools.copy_async(res.x_rows)
        w_rows = res.weights_rows.clone()
        layer.pools.wait_prefetch()
        w = layer.w_compact
        h = grouped_mm(res.x_rows, w["gate"], offs)
        u = grouped_mm(res.x_rows, w["up"], offs)
        layer.pools.wait_copy()
        y_in = buffer.combine_input(plan)
        if buffer.kernel_path == "triton":  # triton: CUDA machines only
            from moonep.kernels.route_weights import scale_rows
            from moonep.kernels.swiglu import swiglu_forward

            o = grouped_mm(swiglu_forward(h, u), w["down"], offs)
            scale_rows(o, w_rows, y_in)
        else:
            o = grouped_mm(F.silu(h) * u, w["down"], offs)
            torch.mul(o, w_rows[:, None], out=y_in)  # fp32 product, rounded once into the symmetric rows
        y_sH, _ = buffer.combine(plan, y_in)
        ctx.save_for_backward(x_rows, w_rows, h, u, o)
        ctx.plan, ctx.buffer, ctx.layer = plan, buffer, layer
        ctx.wgrad_scale = layer.pools.wgrad_scale  # as configured for this forward
        ctx.weights_dtype = weights_sK.dtype
        return y_sH

    @staticmethod
    def backward(ctx, grad_y_sH):
        x_rows, w_rows, h, u, o = ctx.saved_tensors
        plan, buffer, layer = ctx.plan, ctx.buffer, ctx.layer
        offs = plan.cu_seqlens
        layer.pools.ensure_async(plan, layer)  # re-prefetch (another layer used the slots) overlaps dispatch
        gy = buffer.dispatch(grad_y_sH.contiguous(), plan=plan).x_rows
        triton_path = buffer.kernel_path == "triton"
        if triton_path:  # triton: CUDA machines only
            from moonep.kernels.route_weights import route_backward
            from moonep.kernels.swiglu import swiglu_backward

            grad_o, grad_w_rows = route_backward(gy, o, w_rows)
        else:
            grad_o, grad_w_rows = route_backward_torch(gy, o, w_rows)
        layer.pools.wait_prefetch()
        w = layer.w_compact
        grad_a = grouped_mm(grad_o, w["down"].transpose(1, 2), offs)
        if triton_path:
            grad_h, grad_u, a = swiglu_backward(grad_a, h, u)
        else:
            grad_h, grad_u, a = swiglu_backward_torch(grad_a, h, u)
        # bf16 + bf16 adds in fp32 and rounds once (torch's opmath): the fp32 sum's bits, no fp32 temporary
        grad_x_rows = grouped_mm(grad_h, w["gate"].transpose(1, 2), offs)
        grad_x_rows.add_(grouped_mm(grad_u, w["up"].transpose(1, 2), offs))
        pools = layer.pools
        if ctx.prev is not None:  # the slots' last reader is queued: the next layer's copies overlap the wgrads
            prev_layer, prev_plan = ctx.prev
            ctx.prev = None  # once (a retained graph's second backward just prefetches as usual)
            pools.prefetch_async(prev_plan, prev_layer)
        pools.accumulate_wgrad(layer, "down", a, grad_o, offs, ctx.wgrad_scale)
        pools.accumulate_wgrad(layer, "gate", x_rows, grad_h, offs, ctx.wgrad_scale)
        pools.accumulate_wgrad(layer, "up", x_rows, grad_u, offs, ctx.wgrad_scale)
        grad_x_sH, grad_weights_sK = buffer.combine(plan, grad_x_rows, row_scalars=grad_w_rows)
        buffer.reduce_grad_async(plan, layer)
        return grad_x_sH, grad_weights_sK.to(ctx.weights_dtype), None, None, None, None, None


def expert_swiglu(buffer: Buffer, pools: ExpertPools, layer: LayerExperts, x_sH: torch.Tensor,
                  weights_sK: torch.Tensor, topk_sK: torch.Tensor,
                  tokens_per_expert_E: torch.Tensor | None = None) -> torch.Tensor:
    """Routed SwiGLU experts of one MoE layer: y[t] = sum_k w[t,k] * expert_{topk[t,k]}(x[t]).

    Differentiable in x_sH and weights_sK; expert weight grads accumulate (fp32) into
    `layer.g_local` after reduce_grad, which backward leaves queued on the buffer's communication
    stream: call `buffer.wait_pending()` before reading them (any later call on the buffer also
    orders after it). Collective: every rank of the buffer's group calls it."""
    if layer.pools is not pools or pools.buffer is not buffer:
        raise ValueError("layer does not belong to these pools/buffer; pass the objects it was created from")
    missing = [p for p in PROJECTIONS if p not in pools.projections]
    if missing:
        raise ValueError(f"expert_swiglu needs projections {PROJECTIONS}, pools lack {missing}; build them with "
                         "moonep.moe.swiglu_projections(H, F)")
    track = torch.is_grad_enabled() and (x_sH.requires_grad or weights_sK.requires_grad)
    return _ExpertSwiGLU.apply(x_sH, weights_sK, topk_sK, tokens_per_expert_E, buffer, layer, track)
