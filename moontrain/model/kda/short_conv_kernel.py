"""Triton kernels of KDA's causal short convolution + SiLU, forward and backward
(moontrain.model.kda.short_conv is the specification).

Legend: B batch, T sequence, C channels, W conv taps (kda_conv_size), NB (batch, time block) programs.

    pre[t] = sum_{s<W} w[c, W-1-s] x[t-s]  over taps with t-s >= 0 and doc[t-s] == doc[t]     y = silu(pre)
    dpre   = dy silu'(pre)                 silu'(p) = sig(p) (1 + p (1 - sig(p)))
    dx[t]  = sum_{s<W} w[c, W-1-s] dpre[t+s]  over t+s < T and doc[t+s] == doc[t]
    dw[c, W-1-s] = sum_{b,t} dpre[t] x[t-s]  over the forward's taps
Every program covers (a channel block, a time block, a batch row). The forward reads the W shifted x tiles
(rows t-W+1..t; the overlap between neighbouring programs hits the cache), accumulates in fp32, stores y in
x's dtype. The backward is two kernels: the first recomputes pre (nothing but x, w and the document ids is
saved), stores dpre in x's dtype (the precision the specification's autograd has it in) and writes its
fp32 dw partial; the second sums dx from W shifted dpre tiles. dw is deterministic: each (batch, time block)
program writes its fp32 [C, W] partial to its own slot of an [NB, C, W] buffer, one torch sum over NB
follows (no atomics).

The walking backward (kernels.short_conv_backward=walk; W <= WALK_TAPS): each program, a channel block of a
batch row, walks its WALK_SPAN rows down one at a time with x[t-3..t], dpre[t+1..t+3] and the document ids
around t in registers: pre[t], dpre[t] (fp32), dx[t] from dpre[t..t+3] (rounded once), dpre[t] x[t-s] into its
dw partial; three rows above the span first, for their dpre. No dpre tensor, each row of x and dy read about
once. The default backward since it was measured (docs/performance.md; bench_short_conv.py sweeps it).

Inputs: x [B, T, C] with unit channel stride, any batch and time strides (a column slice of a projection
output is read in place); w the [C, 1, W] parameter (fp32 or bf16); doc_id int64 [B, T] or None (a constexpr:
the no-document kernel loads no ids). dx is contiguous in x's dtype, dw in w's dtype.

torch.compile: the launches are torch.library.triton_ops (wrap_triton), the backward is registered with
register_autograd from ShortConvFunction's setup_context/backward, so a compiled region traces through the
convolution without a graph break (Inductor sees the Triton kernels). Under TRITON_INTERPRET=1 wrap_triton
hands back the interpreted kernel, which runs eagerly but cannot be traced with fake tensors.

Cost at [4, 4096, 2048] bf16, x a column slice, no documents (H200, 2026-12-04, in a training step): forward
58 us, dpre 219 us, dx 44 us (HBM alone: ~36, ~55, ~36 us); dpre's tiles do not help: it is slow by structure.

Rejected: atomics into dw (order-dependent sums); saving y or pre (one more [B, T, C] tensor per conv); one
backward kernel recomputing dpre for every shift (W * W + 2 W tile loads per program: ~480 us, 8x its
traffic); a dpre program walking 256 rows with the W taps as one [W, rows, channels] tile and one reduction
at the end (1.3-1.5x slower, docs/performance.md); autotuning (fixed tiles keep the dw partials' reduction
order, hence the result, independent of the run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moontrain.model.config import SHORT_CONV_WALK_TAPS

FWD_BLOCK_T, FWD_BLOCK_C = 32, 128  # within 2 us of the best of 10 tiles of 8-64 x 64-512, 2-8 warps (device alone)
BWD_BLOCK_T, BWD_BLOCK_C = 64, 64
NUM_WARPS = 4
# the walking backward: rows a program walks (128: the fastest of 11 spans x channel blocks x warps, device alone, on
# an H100), its channels (4 a thread at 4 warps); the most taps it takes is the config's (checked before a run)
WALK_SPAN, WALK_BLOCK_C, WALK_WARPS, WALK_TAPS = 128, 512, 4, SHORT_CONV_WALK_TAPS
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_rows(ptr, rows, cols, stride_t, T, C):
    """fp32 tile ptr[rows, cols] with zeros outside [0, T) x [0, C)."""
    mask = ((rows >= 0) & (rows < T))[:, None] & (cols < C)[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _same_doc(doc_ptr, rows_a, rows_b, stride_dt, T):
    """doc[rows_a] == doc[rows_b] per row (rows outside [0, T) compare ids of 0: their tiles are zero)."""
    doc_a = tl.load(doc_ptr + rows_a * stride_dt, mask=(rows_a >= 0) & (rows_a < T), other=0)
    doc_b = tl.load(doc_ptr + rows_b * stride_dt, mask=(rows_b >= 0) & (rows_b < T), other=0)
    return doc_a == doc_b


@triton.jit
def _tap(x_ptr, doc_ptr, rows, s, cols, stride_xt, stride_dt, T, C, HAS_DOCS: tl.constexpr):
    """x[rows - s] where it is a tap of rows (inside rows' document), else 0; fp32."""
    x = _load_rows(x_ptr, rows - s, cols, stride_xt, T, C)
    if HAS_DOCS:
        x = tl.where(_same_doc(doc_ptr, rows - s, rows, stride_dt, T)[:, None], x, 0.0)
    return x


@triton.jit
def _pre(x_ptr, w_ptr, doc_ptr, rows, cols, stride_xt, stride_wc, stride_ww, stride_dt, T, C,
         W: tl.constexpr, HAS_DOCS: tl.constexpr):
    """pre[rows, cols] in fp32."""
    acc = tl.zeros((rows.shape[0], cols.shape[0]), dtype=tl.float32)
    for s in tl.static_range(W):
        w = tl.load(w_ptr + cols * stride_wc + (W - 1 - s) * stride_ww, mask=cols < C, other=0.0).to(tl.float32)
        acc += _tap(x_ptr, doc_ptr, rows, s, cols, stride_xt, stride_dt, T, C, HAS_DOCS) * w[None, :]
    return acc


@triton.jit
def _short_conv_fwd_kernel(x_ptr, w_ptr, doc_ptr, y_ptr, T, C,
                           stride_xb, stride_xt, stride_wc, stride_ww, stride_db, stride_dt,
                           W: tl.constexpr, HAS_DOCS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    x_ptr += b * stride_xb
    if HAS_DOCS:
        doc_ptr += b * stride_db
    pre = _pre(x_ptr, w_ptr, doc_ptr, rows, cols, stride_xt, stride_wc, stride_ww, stride_dt, T, C, W, HAS_DOCS)
    y = pre / (1.0 + tl.exp(-pre))
    y_ptr += b * T * C
    mask = (rows < T)[:, None] & (cols < C)[None, :]
    tl.store(y_ptr + rows[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _short_conv_dpre_kernel(x_ptr, w_ptr, doc_ptr, dy_ptr, dpre_ptr, dw_part_ptr, T, C,
                            stride_xb, stride_xt, stride_wc, stride_ww, stride_db, stride_dt, stride_gb, stride_gt,
                            W: tl.constexpr, HAS_DOCS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dpre = dy silu'(pre) (pre recomputed) stored in x's dtype, and the program's fp32 dw partial."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    x_ptr += b * stride_xb
    dy_ptr += b * stride_gb
    if HAS_DOCS:
        doc_ptr += b * stride_db
    cmask = cols < C
    pre = _pre(x_ptr, w_ptr, doc_ptr, rows, cols, stride_xt, stride_wc, stride_ww, stride_dt, T, C, W, HAS_DOCS)
    sig = 1.0 / (1.0 + tl.exp(-pre))
    dpre = _load_rows(dy_ptr, rows, cols, stride_gt, T, C) * sig * (1.0 + pre * (1.0 - sig))
    mask = (rows < T)[:, None] & cmask[None, :]
    dpre_ptr += b * T * C
    tl.store(dpre_ptr + rows[:, None] * C + cols[None, :], dpre.to(dpre_ptr.dtype.element_ty), mask=mask)
    part_ptr = dw_part_ptr + ((b * tl.num_programs(1) + tl.program_id(1)) * C + cols) * W
    for s in tl.static_range(W):
        x = _tap(x_ptr, doc_ptr, rows, s, cols, stride_xt, stride_dt, T, C, HAS_DOCS)
        tl.store(part_ptr + (W - 1 - s), tl.sum(dpre * x, axis=0), mask=cmask)


@triton.jit
def _short_conv_dx_kernel(dpre_ptr, w_ptr, doc_ptr, dx_ptr, T, C, stride_wc, stride_ww, stride_db, stride_dt,
                          W: tl.constexpr, HAS_DOCS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx[t] = sum_s w[W-1-s] dpre[t+s] over t+s < T inside t's document (dpre contiguous [B, T, C])."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    dpre_ptr += b * T * C
    if HAS_DOCS:
        doc_ptr += b * stride_db
    cmask = cols < C
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(W):
        d = _load_rows(dpre_ptr, rows + s, cols, C, T, C)
        if HAS_DOCS:
            if s > 0:
                d = tl.where(_same_doc(doc_ptr, rows + s, rows, stride_dt, T)[:, None], d, 0.0)
        w = tl.load(w_ptr + cols * stride_wc + (W - 1 - s) * stride_ww, mask=cmask, other=0.0).to(tl.float32)
        dx += d * w[None, :]
    dx_ptr += b * T * C
    mask = (rows < T)[:, None] & cmask[None, :]
    tl.store(dx_ptr + rows[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row(ptr, t, cols, stride_t, T, C):
    """fp32 row ptr[t, cols], zeros outside [0, T) x [0, C)."""
    return tl.load(ptr + t * stride_t + cols, mask=(cols < C) & (t >= 0) & (t < T), other=0.0).to(tl.float32)


@triton.jit
def _doc(doc_ptr, t, stride_dt, T, HAS_DOCS: tl.constexpr):
    """doc[t] (0 outside [0, T), where the rows it is compared for are zero); 0 without documents."""
    if HAS_DOCS:
        return tl.load(doc_ptr + t * stride_dt, mask=(t >= 0) & (t < T), other=0)
    else:
        return 0


@triton.jit
def _tap_weight(w_ptr, cols, s: tl.constexpr, stride_wc, stride_ww, C, W: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 w[cols, W-1-s], the weight of tap x[t-s]; zero for s >= W."""
    if s < W:
        return tl.load(w_ptr + cols * stride_wc + (W - 1 - s) * stride_ww, mask=cols < C, other=0.0).to(tl.float32)
    else:
        return tl.zeros((BLOCK_C,), tl.float32)


@triton.jit
def _short_conv_bwd_walk_kernel(x_ptr, w_ptr, doc_ptr, dy_ptr, dx_ptr, dw_part_ptr, T, C,
                                stride_xb, stride_xt, stride_wc, stride_ww, stride_db, stride_dt, stride_gb, stride_gt,
                                W: tl.constexpr, HAS_DOCS: tl.constexpr, SPAN: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx and the program's fp32 dw partial in one walk down its SPAN rows (WALK_TAPS = 4 taps at most)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_end = (tl.program_id(1) + 1) * SPAN  # the span is [t_end - SPAN, t_end)
    b = tl.program_id(2).to(tl.int64)
    x_ptr += b * stride_xb
    dy_ptr += b * stride_gb
    dx_ptr += b * T * C
    if HAS_DOCS:
        doc_ptr += b * stride_db
    w0 = _tap_weight(w_ptr, cols, 0, stride_wc, stride_ww, C, W, BLOCK_C)
    w1 = _tap_weight(w_ptr, cols, 1, stride_wc, stride_ww, C, W, BLOCK_C)
    w2 = _tap_weight(w_ptr, cols, 2, stride_wc, stride_ww, C, W, BLOCK_C)
    w3 = _tap_weight(w_ptr, cols, 3, stride_wc, stride_ww, C, W, BLOCK_C)
    # the walk starts three rows above the span: their dpre enters the span's top rows' dx
    t = t_end + 2
    x0 = _row(x_ptr, t, cols, stride_xt, T, C)  # x[t], x[t-1], x[t-2]; x[t-3] is loaded in the loop
    x1 = _row(x_ptr, t - 1, cols, stride_xt, T, C)
    x2 = _row(x_ptr, t - 2, cols, stride_xt, T, C)
    k0 = _doc(doc_ptr, t, stride_dt, T, HAS_DOCS)  # doc of t, t-1, t-2 and of t+1, t+2, t+3
    k1 = _doc(doc_ptr, t - 1, stride_dt, T, HAS_DOCS)
    k2 = _doc(doc_ptr, t - 2, stride_dt, T, HAS_DOCS)
    kp1 = _doc(doc_ptr, t + 1, stride_dt, T, HAS_DOCS)
    kp2 = _doc(doc_ptr, t + 2, stride_dt, T, HAS_DOCS)
    kp3 = _doc(doc_ptr, t + 3, stride_dt, T, HAS_DOCS)
    dp1 = tl.zeros((BLOCK_C,), tl.float32)  # dpre of t+1, t+2, t+3
    dp2 = tl.zeros((BLOCK_C,), tl.float32)
    dp3 = tl.zeros((BLOCK_C,), tl.float32)
    acc0 = tl.zeros((BLOCK_C,), tl.float32)  # dw partial of tap s: sum over the span of dpre[t] x[t-s]
    acc1 = tl.zeros((BLOCK_C,), tl.float32)
    acc2 = tl.zeros((BLOCK_C,), tl.float32)
    acc3 = tl.zeros((BLOCK_C,), tl.float32)
    # each row's loads are issued one row ahead (Triton does not pipeline these loads itself): two rows in flight
    x3_next = _row(x_ptr, t - 3, cols, stride_xt, T, C)
    dy_next = _row(dy_ptr, t, cols, stride_gt, T, C)
    k3_next = _doc(doc_ptr, t - 3, stride_dt, T, HAS_DOCS)
    for _ in range(0, SPAN + 3):
        x3, dy_t, k3 = x3_next, dy_next, k3_next
        x3_next = _row(x_ptr, t - 4, cols, stride_xt, T, C)
        dy_next = _row(dy_ptr, t - 1, cols, stride_gt, T, C)
        k3_next = _doc(doc_ptr, t - 4, stride_dt, T, HAS_DOCS)
        tap1 = tl.where(k1 == k0, x1, 0.0)  # the taps inside t's document
        tap2 = tl.where(k2 == k0, x2, 0.0)
        tap3 = tl.where(k3 == k0, x3, 0.0)
        pre = w0 * x0 + w1 * tap1 + w2 * tap2 + w3 * tap3
        sig = 1.0 / (1.0 + tl.exp(-pre))
        dpre = dy_t * sig * (1.0 + pre * (1.0 - sig))
        mine = t < t_end  # a row of the span (the first three are the halo above it)
        dx = (w0 * dpre + w1 * tl.where(kp1 == k0, dp1, 0.0) + w2 * tl.where(kp2 == k0, dp2, 0.0)
              + w3 * tl.where(kp3 == k0, dp3, 0.0))
        tl.store(dx_ptr + t * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=(cols < C) & mine & (t < T))
        keep = tl.where(mine, dpre, 0.0)
        acc0 += keep * x0
        acc1 += keep * tap1
        acc2 += keep * tap2
        acc3 += keep * tap3
        dp3, dp2, dp1 = dp2, dp1, dpre
        kp3, kp2, kp1 = kp2, kp1, k0
        x0, x1, x2 = x1, x2, x3
        k0, k1, k2 = k1, k2, k3
        t -= 1
    part_ptr = dw_part_ptr + ((b * tl.num_programs(1) + tl.program_id(1)) * C + cols) * W
    cmask = cols < C
    tl.store(part_ptr + (W - 1), acc0, mask=cmask)
    if W > 1:
        tl.store(part_ptr + (W - 2), acc1, mask=cmask)
    if W > 2:
        tl.store(part_ptr + (W - 3), acc2, mask=cmask)
    if W > 3:
        tl.store(part_ptr + (W - 4), acc3, mask=cmask)


def _doc_strides(doc_id_BT: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if doc_id_BT is None else (doc_id_BT.stride(0), doc_id_BT.stride(1))


@torch.library.triton_op("moontrain::short_conv_silu", mutates_args=())
def _short_conv_silu_op(x_BTC: torch.Tensor, w_C1W: torch.Tensor, doc_id_BT: torch.Tensor | None,
                        walk: bool = False) -> torch.Tensor:
    """y; walk: which backward kernels its gradient runs (ShortConvFunction.backward)."""
    B, T, C = x_BTC.shape
    W = w_C1W.shape[-1]
    y_BTC = torch.empty((B, T, C), dtype=x_BTC.dtype, device=x_BTC.device)
    grid = (triton.cdiv(C, FWD_BLOCK_C), triton.cdiv(T, FWD_BLOCK_T), B)
    torch.library.wrap_triton(_short_conv_fwd_kernel)[grid](
        x_BTC, w_C1W, doc_id_BT, y_BTC, T, C,
        x_BTC.stride(0), x_BTC.stride(1), w_C1W.stride(0), w_C1W.stride(2), *_doc_strides(doc_id_BT),
        W=W, HAS_DOCS=doc_id_BT is not None, BLOCK_T=FWD_BLOCK_T, BLOCK_C=FWD_BLOCK_C, num_warps=NUM_WARPS)
    return y_BTC


def _backward_launch(kernel, dy_BTC: torch.Tensor, x_BTC: torch.Tensor, w_C1W: torch.Tensor,
                     doc_id_BT: torch.Tensor | None, rows: int, block_c: int, num_warps: int, **tile: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One backward kernel over programs of `rows` rows x `block_c` channels per batch row: (its [B, T, C] output
    in x's dtype, dw from its per-program fp32 partials in w's dtype)."""
    B, T, C = x_BTC.shape
    W = w_C1W.shape[-1]
    num_row_blocks = triton.cdiv(T, rows)
    out_BTC = torch.empty((B, T, C), dtype=x_BTC.dtype, device=x_BTC.device)
    dw_part_NCW = torch.empty((B * num_row_blocks, C, W), dtype=torch.float32, device=x_BTC.device)
    torch.library.wrap_triton(kernel)[(triton.cdiv(C, block_c), num_row_blocks, B)](
        x_BTC, w_C1W, doc_id_BT, dy_BTC, out_BTC, dw_part_NCW, T, C,
        x_BTC.stride(0), x_BTC.stride(1), w_C1W.stride(0), w_C1W.stride(2), *_doc_strides(doc_id_BT),
        dy_BTC.stride(0), dy_BTC.stride(1),
        W=W, HAS_DOCS=doc_id_BT is not None, BLOCK_C=block_c, num_warps=num_warps, **tile)
    return out_BTC, dw_part_NCW.sum(0).to(w_C1W.dtype).unsqueeze(1)


@torch.library.triton_op("moontrain::short_conv_silu_dpre", mutates_args=())
def _short_conv_silu_dpre_op(dy_BTC: torch.Tensor, x_BTC: torch.Tensor, w_C1W: torch.Tensor,
                             doc_id_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dpre [B, T, C] in x's dtype, dw in w's dtype)."""
    return _backward_launch(_short_conv_dpre_kernel, dy_BTC, x_BTC, w_C1W, doc_id_BT, BWD_BLOCK_T, BWD_BLOCK_C,
                            NUM_WARPS, BLOCK_T=BWD_BLOCK_T)


@torch.library.triton_op("moontrain::short_conv_silu_bwd_walk", mutates_args=())
def _short_conv_silu_bwd_walk_op(dy_BTC: torch.Tensor, x_BTC: torch.Tensor, w_C1W: torch.Tensor,
                                 doc_id_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C] contiguous in x's dtype, dw in w's dtype) in one walk (W <= WALK_TAPS)."""
    return _backward_launch(_short_conv_bwd_walk_kernel, dy_BTC, x_BTC, w_C1W, doc_id_BT, WALK_SPAN, WALK_BLOCK_C,
                            WALK_WARPS, SPAN=WALK_SPAN)


@torch.library.triton_op("moontrain::short_conv_silu_dx", mutates_args=())
def _short_conv_silu_dx_op(dpre_BTC: torch.Tensor, w_C1W: torch.Tensor, doc_id_BT: torch.Tensor | None
                           ) -> torch.Tensor:
    B, T, C = dpre_BTC.shape
    dx_BTC = torch.empty((B, T, C), dtype=dpre_BTC.dtype, device=dpre_BTC.device)
    grid = (triton.cdiv(C, FWD_BLOCK_C), triton.cdiv(T, FWD_BLOCK_T), B)
    torch.library.wrap_triton(_short_conv_dx_kernel)[grid](
        dpre_BTC, w_C1W, doc_id_BT, dx_BTC, T, C, w_C1W.stride(0), w_C1W.stride(2), *_doc_strides(doc_id_BT),
        W=w_C1W.shape[-1], HAS_DOCS=doc_id_BT is not None, BLOCK_T=FWD_BLOCK_T, BLOCK_C=FWD_BLOCK_C,
        num_warps=NUM_WARPS)
    return dx_BTC


class ShortConvFunction(torch.autograd.Function):
    """The convolution's autograd; its setup_context and backward are also the custom op's (register_autograd),
    so `apply` (eager) and the op (traceable by torch.compile) differentiate alike."""

    @staticmethod
    def forward(x_BTC: torch.Tensor, w_C1W: torch.Tensor, doc_id_BT: torch.Tensor | None,
                walk: bool = False) -> torch.Tensor:
        return torch.ops.moontrain.short_conv_silu(x_BTC, w_C1W, doc_id_BT, walk)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x_BTC, w_C1W, doc_id_BT, *walk = inputs
        ctx.save_for_backward(x_BTC, w_C1W, doc_id_BT)
        ctx.walk = bool(walk and walk[0])

    @staticmethod
    def backward(ctx, dy_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x_BTC, w_C1W, doc_id_BT = ctx.saved_tensors
        if dy_BTC.stride(-1) != 1:  # e.g. an expanded gradient of a sum
            dy_BTC = dy_BTC.contiguous()
        if ctx.walk:
            dx_BTC, dw_C1W = torch.ops.moontrain.short_conv_silu_bwd_walk(dy_BTC, x_BTC, w_C1W, doc_id_BT)
            return dx_BTC, dw_C1W, None, None
        dpre_BTC, dw_C1W = torch.ops.moontrain.short_conv_silu_dpre(dy_BTC, x_BTC, w_C1W, doc_id_BT)
        return torch.ops.moontrain.short_conv_silu_dx(dpre_BTC, w_C1W, doc_id_BT), dw_C1W, None, None


torch.library.register_autograd("moontrain::short_conv_silu", ShortConvFunction.backward,
                                setup_context=ShortConvFunction.setup_context)


def short_conv_silu(x_BTC: torch.Tensor, w_C1W: torch.Tensor, doc_id_BT: torch.Tensor | None, *,
                    backward: str = "tiles") -> torch.Tensor:
    """silu(causal depthwise conv of x with w inside each document), kda.short_conv's values in x's dtype
    (fp32 accumulation). x may be a column slice of a wider tensor (unit channel stride, any other strides);
    differentiable in x and w; traceable by torch.compile (fullgraph). backward (kernels.short_conv_backward):
    "tiles", dpre then dx over [time, channel] tiles; "walk", one kernel walking each program's rows (at most
    WALK_TAPS taps)."""
    if x_BTC.dim() != 3:
        raise ValueError(f"short_conv_silu: x must be [B, T, C], got shape {tuple(x_BTC.shape)}; "
                         "reshape the projection output to [batch, tokens, channels]")
    B, T, C = x_BTC.shape
    if w_C1W.dim() != 3 or w_C1W.shape[:2] != (C, 1) or w_C1W.shape[2] < 1:
        raise ValueError(f"short_conv_silu: w must be [C, 1, W] = [{C}, 1, W] (nn.Conv1d's depthwise weight), "
                         f"got shape {tuple(w_C1W.shape)}; pass the conv parameter itself")
    if x_BTC.stride(-1) != 1:
        raise ValueError(f"short_conv_silu: x needs unit channel stride, got strides {x_BTC.stride()}; "
                         "slice columns of a row-major tensor, or call .contiguous() first")
    for name, t in (("x", x_BTC), ("w", w_C1W)):
        if t.dtype not in DTYPES:
            raise ValueError(f"short_conv_silu: {name} has dtype {t.dtype}; the kernel takes float32, bfloat16 "
                             "or float16: cast it")
    if doc_id_BT is not None and (doc_id_BT.shape != (B, T) or doc_id_BT.dtype != torch.int64):
        raise ValueError(f"short_conv_silu: doc_id must be int64 [B, T] = [{B}, {T}], got {doc_id_BT.dtype} "
                         f"{tuple(doc_id_BT.shape)}; pass the batch's document ids (or None: one document per row)")
    row_stride = max(x_BTC.stride(1), C)  # x's rows, and dpre's / dx's contiguous ones
    if T * row_stride >= 2 ** 31:
        raise ValueError(f"short_conv_silu: T * row stride = {T} * {row_stride} does not fit the kernels' int32 row "
                         "offsets (< 2^31); split the sequence into shorter rows (a larger batch)")
    devices = {t.device for t in (x_BTC, w_C1W, doc_id_BT) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"short_conv_silu: x, w and doc_id on different devices {sorted(map(str, devices))}; "
                         "move them to x's device")
    if backward not in ("tiles", "walk"):
        raise ValueError(f"short_conv_silu: backward must be 'tiles' or 'walk', got {backward!r}")
    if backward == "walk" and w_C1W.shape[2] > WALK_TAPS:
        raise ValueError(f"short_conv_silu: the walking backward takes at most {WALK_TAPS} taps, w has "
                         f"{w_C1W.shape[2]}; kernels.short_conv_backward=tiles takes any")
    return torch.ops.moontrain.short_conv_silu(x_BTC, w_C1W, doc_id_BT, backward == "walk")
