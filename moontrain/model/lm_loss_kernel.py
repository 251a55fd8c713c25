"""Triton kernels of one chunk of the fused head's cross-entropy (moontrain.model.lm_loss's chunk_loss_and_grad
and chunk_loss are the specification; kernels.lm_loss picks these).

Legend: c tokens in the chunk, V vocab, S splits of a row's V, BV columns per tile.

    lse = log sum_v exp(x_v)      loss = sum_rows (lse - x_target)      grad_v = exp(x_v - lse) / N - [v = target] / N

Two passes over the chunk's logits (in the compute dtype, [c, V]):
- _row_stats_kernel, one program per (row, split of V): the split's max and sum of exp(x - max), online over
  its tiles (one exp per element, one rescale per tile), written to [c, S] fp32; _combine_kernel, one program
  per row, combines the S parts into the row's lse and its loss lse - x_target.
- _grad_kernel, one program per (row, tile of V): the gradient above in fp32, rounded once to the logits' dtype
  and written over the logits (they are the chunk's own and dead after it: no second [c, V] tensor).
- _scale_kernel: backward's grad * (grad of the loss) for the saved bf16 gradients of h and the weight (lm_loss's
  _scaled is the specification): one pass reading and writing bf16, the product in fp32 rounded once.
The specification computes the same quantities in ATen's log-softmax order ((x - max) - log sum exp(x - max))
through torch.compile, which reduces each row of V logits in one program; splitting V gives the first pass
c x S programs (the two timed against each other: benchmarks/bench_lm_loss.py --chunk-math-only).

Numerics against the specification: the same formulas in fp32; the row sums are summed in another order (per
split, then across splits), so the lse and the loss differ in the last bits of fp32 and the gradient by at
most one rounding step of its dtype; tests/moontrain/model/test_lm_loss_kernel_interpreted.py holds them to
the bounds it derives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# columns per tile and warps (both passes); columns per split of a row in the first pass (a multiple of BLOCK_V)
BLOCK_V, SPLIT_V, WARPS = 2048, 16384, 8
SCALE_BLOCK = 4096  # elements per program of the scale pass (32 a thread at 4 warps: 16-byte loads)


@triton.jit
def _row_stats_kernel(x_ptr, max_ptr, sum_ptr, V, S, SPLIT: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * V
    start = part * SPLIT
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in tl.range(start, start + SPLIT, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every split holds at least one column below V
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(max_ptr + row * S + part, m)
    tl.store(sum_ptr + row * S + part, s)


@triton.jit
def _combine_kernel(x_ptr, t_ptr, max_ptr, sum_ptr, lse_ptr, loss_ptr, V, S, S_P: tl.constexpr):
    """Per row: the lse from the S parts, and lse - x_target."""
    row = tl.program_id(0)
    parts = tl.arange(0, S_P)
    ok = parts < S
    m = tl.load(max_ptr + row * S + parts, mask=ok, other=float("-inf"))
    s = tl.load(sum_ptr + row * S + parts, mask=ok, other=0.0)
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    target = tl.load(t_ptr + row)
    x_t = tl.load(x_ptr + row.to(tl.int64) * V + target).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, lse - x_t)


@triton.jit
def _grad_kernel(x_ptr, lse_ptr, t_ptr, V, inv_n, BV: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ok = cols < V
    ptrs = x_ptr + row.to(tl.int64) * V + cols
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    target = tl.load(t_ptr + row)
    p = tl.exp(x - lse) * inv_n
    g = tl.where(cols == target, p - inv_n, p)
    tl.store(ptrs, g.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even (torch's cast; the interpreter's own cast truncates), NaN kept NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x == x, rounded, x.to(tl.bfloat16))


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
    tl.store(y_ptr + offs, _bf16_rne(y), mask=ok)


def scaled_bf16(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """lm_loss._scaled for a contiguous bf16 gradient and a one-element scale on its device: a new tensor,
    bitwise the specification's."""
    if grad.dtype != torch.bfloat16 or not grad.is_contiguous() or scale.numel() != 1 or scale.device != grad.device:
        raise ValueError(f"scaled_bf16 takes a contiguous bf16 gradient and a one-element scale on its device, got "
                         f"{grad.dtype} (contiguous: {grad.is_contiguous()}) and a scale of {scale.numel()} elements "
                         f"on {scale.device}; lm_loss._scaled takes the others")
    out = torch.empty_like(grad)
    _scale_kernel[(triton.cdiv(grad.numel(), SCALE_BLOCK),)](grad, scale, out, grad.numel(), BLOCK=SCALE_BLOCK,
                                                             num_warps=4)
    return out


def _check(logits_cV: torch.Tensor, targets_c: torch.Tensor) -> torch.Tensor:
    """The targets, contiguous. Their values are token ids in [0, V), as lm_loss's contract says (the data
    pipeline checks every id against the vocabulary); the kernels do not check them again (a host sync)."""
    if logits_cV.dim() != 2 or not logits_cV.is_contiguous() or targets_c.shape != logits_cV.shape[:1]:
        raise ValueError(f"the CE kernels take contiguous logits [c, V] and targets [c], got logits "
                         f"{tuple(logits_cV.shape)} (contiguous: {logits_cV.is_contiguous()}) and targets "
                         f"{tuple(targets_c.shape)}")
    return targets_c.contiguous()


def _row_lse_and_loss(logits_cV: torch.Tensor, targets_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-sum-exp and its loss lse - x_target (fp32 [c] both)."""
    c, V = logits_cV.shape
    split = min(SPLIT_V, triton.cdiv(V, BLOCK_V) * BLOCK_V)
    S = triton.cdiv(V, split)
    max_cS = torch.empty(c, S, dtype=torch.float32, device=logits_cV.device)
    sum_cS = torch.empty_like(max_cS)
    _row_stats_kernel[(c, S)](logits_cV, max_cS, sum_cS, V, S, SPLIT=split, BV=BLOCK_V, num_warps=WARPS)
    lse_c = torch.empty(c, dtype=torch.float32, device=logits_cV.device)
    loss_c = torch.empty_like(lse_c)
    _combine_kernel[(c,)](logits_cV, targets_c, max_cS, sum_cS, lse_c, loss_c, V, S, S_P=triton.next_power_of_2(S),
                          num_warps=1)
    return lse_c, loss_c


def chunk_loss(logits_cV: torch.Tensor, targets_c: torch.Tensor) -> torch.Tensor:
    """lm_loss.chunk_loss in the first pass: the sum over the chunk's tokens of -log softmax(logits)[target], fp32."""
    targets_c = _check(logits_cV, targets_c)
    return _row_lse_and_loss(logits_cV, targets_c)[1].sum()


def chunk_loss_and_grad(logits_cV: torch.Tensor, targets_c: torch.Tensor, inv_n: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_loss.chunk_loss_and_grad in both passes: (the chunk's summed loss, fp32; the grad of the mean over all
    N tokens (inv_n = 1 / N) with respect to the logits, in their dtype, written over logits_cV and returned)."""
    targets_c = _check(logits_cV, targets_c)
    lse_c, loss_c = _row_lse_and_loss(logits_cV, targets_c)
    loss = loss_c.sum()
    c, V = logits_cV.shape
    _grad_kernel[(c, triton.cdiv(V, BLOCK_V))](logits_cV, lse_c, targets_c, V, inv_n, BV=BLOCK_V, num_warps=WARPS)
    return loss, logits_cV
