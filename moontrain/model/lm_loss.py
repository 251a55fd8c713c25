"""The LM head and the mean token cross-entropy in one op, over chunks of tokens: no [N, V] logits survive a chunk.

Legend: N tokens, D hidden, V vocab, c tokens per chunk.

Value: linear_cross_entropy(h, W, t) equals F.cross_entropy((h @ W^T).float(), t), the head as nn.Linear
computes it (in h's dtype) and the CE in fp32, mean over all N tokens. There is no ignore index: every
target is a token id in [0, V) (the data pipeline writes no other).

Forward, per chunk of c tokens: logits_cV = h_c @ W^T in the compute dtype; in fp32 the log-softmax in ATen's
order ((x - max) - log sum exp), the chunk's summed target log-probabilities, and the logits' grad as autograd
makes it (softmax * 1/N, then -1/N at the target), rounded once to the compute dtype as the backward of
`.float()` rounds it; then grad_h_c = grad_logits_cV @ W (complete: the sum runs over V) and grad_W +=
grad_logits_cV^T @ h_c into an fp32 [V, D] accumulator that the first chunk's GEMM writes (no zero fill; products
of the compute dtype, fp32 sums, rounded once to W's dtype after the last chunk). Only grad_h [N, D] and grad_W [V, D] are saved; backward scales them
by the scalar grad of the loss (fp32, rounded once; one Triton pass each with kernels.lm_loss's kernels).
Without grad (evaluation) the forward computes the loss alone, in the same chunks and order.

Numerics against autograd over the materialised logits: the same formulas and roundings; the sums differ
in order only (the loss over chunks, grad_W over chunks in fp32). With a compute dtype below fp32 grad_W
and grad_h carry one more rounding when the loss's grad is not a power of two (the scale in backward).

Chunk size: the most tokens whose fp32 logits fit in the math's budget (ChunkMath.logits_bytes), in whole GEMM
tiles of 128 rows: LOGITS_BYTES_PER_CHUNK (1 GiB) for the PyTorch math, 4 GiB for the Triton math, which holds
only the compute-dtype logits. Memory: with train.compile a chunk holds its compute-dtype logits and grad (half
the budget each at bf16), eager about 3.5 times it (the logits, their fp32 log-softmax and two fp32
temporaries), the Triton math a quarter of it at bf16, against [N, V] in the compute dtype plus fp32 and their
grads for the unfused head (k3_small: 5.4 GiB bf16 + 10.7 GiB fp32 at 16k tokens). Speed: every chunk after the
first reads and writes the fp32 accumulator (8 V D bytes) next to its 6 c V D GEMM FLOPs. The budgets are the
measured knees (benchmarks/bench_lm_loss.py on one H200; docs/performance.md, 2026-12-02 and 2026-12-05).

train.compile: the per-chunk fp32 math (chunk_loss_and_grad, chunk_loss) runs through torch.compile, which
fuses it into passes over the compute-dtype logits; the GEMMs stay eager ATen calls either way.
kernels.lm_loss: the same per-chunk math as Triton kernels (moontrain.model.lm_loss_kernel), which also write
the gradient over the chunk's logits.
Rejected: chunking over V (grad_W then needs every token's logsumexp first: the logits GEMM twice); a
compiled whole op (the chunk loop unrolled into one graph per N); saving grad_W in fp32 (twice the bytes
held from the end of forward to the start of backward, for a rounding that only matters when the loss's
grad is not a power of two).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from moontrain.model.kernel_choice import runs_cuda_kernels

LOGITS_BYTES_PER_CHUNK = 1 << 30  # a chunk's logits in fp32 (module docstring: memory against accumulator traffic)
TRITON_LOGITS_BYTES_PER_CHUNK = 4 << 30  # the same budget for the Triton chunk math, which holds only bf16 logits
_TILE = 128  # GEMM rows per tile: chunks of whole tiles


def chunk_tokens(vocab_size: int, logits_bytes: int = LOGITS_BYTES_PER_CHUNK) -> int:
    """Tokens per chunk: the most whose fp32 logits fit in logits_bytes, in whole tiles when at least one fits."""
    rows = max(1, logits_bytes // (4 * vocab_size))
    return rows - rows % _TILE if rows >= _TILE else rows


def _log_softmax_(logits_cV: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax in ATen's order; in place when the logits are fp32 already (they are ours to overwrite)."""
    x_cV = logits_cV.float()
    x_cV -= x_cV.amax(dim=-1, keepdim=True)
    x_cV -= x_cV.exp().sum(dim=-1, keepdim=True).log()
    return x_cV


def chunk_loss(logits_cV: torch.Tensor, targets_c: torch.Tensor) -> torch.Tensor:
    """Sum over the chunk's tokens of -log softmax(logits)[target], fp32."""
    return -_log_softmax_(logits_cV).gather(1, targets_c[:, None]).sum()


def chunk_loss_and_grad(logits_cV: torch.Tensor, targets_c: torch.Tensor, inv_n: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_loss, and the grad of the mean over all N tokens (inv_n = 1 / N) with respect to the logits,
    in the logits' dtype: softmax * inv_n, minus inv_n at the target (autograd's log-softmax backward), in fp32
    and rounded once. The target's subtraction is a select, not an indexed write, so that torch.compile
    fuses the whole grad into one pass from the logits to its rounded output (an indexed write makes it
    materialise the fp32 grad first: one more write and read of [c, V] fp32)."""
    x_cV = _log_softmax_(logits_cV)
    loss = -x_cV.gather(1, targets_c[:, None]).sum()
    p_cV = x_cV.exp_().mul_(inv_n)
    at_target_cV = torch.arange(p_cV.shape[1], device=p_cV.device)[None, :] == targets_c[:, None]
    return loss, torch.where(at_target_cV, p_cV - inv_n, p_cV).to(logits_cV.dtype)


class ChunkMath(NamedTuple):
    loss_and_grad: Any  # chunk_loss_and_grad or its compiled form
    loss: Any  # chunk_loss or its compiled form
    scaled_bf16: Any = None  # backward's scale of a bf16 gradient in one pass (None: _scaled's PyTorch passes)
    logits_bytes: int = LOGITS_BYTES_PER_CHUNK  # the default chunk's fp32 logits (chunk_tokens)


EAGER = ChunkMath(chunk_loss_and_grad, chunk_loss)


def compiled_math() -> ChunkMath:
    """The chunk math through torch.compile (train.compile): one graph per chunk shape, the last chunk's
    remainder being the second."""
    return ChunkMath(torch.compile(chunk_loss_and_grad, dynamic=False), torch.compile(chunk_loss, dynamic=False))


@functools.cache
def triton_math() -> ChunkMath:
    """The chunk math as Triton kernels (moontrain.model.lm_loss_kernel: the gradient written over the chunk's
    logits), the same with or without train.compile."""
    from moontrain.model import lm_loss_kernel as k  # imports triton: only where it runs

    return ChunkMath(k.chunk_loss_and_grad, k.chunk_loss, k.scaled_bf16, TRITON_LOGITS_BYTES_PER_CHUNK)


def chunk_math(choice: str, device: torch.device | str | None) -> ChunkMath:
    """The chunk math kernels.lm_loss = `choice` (auto, torch or triton) runs on `device`: triton_math(), or
    EAGER (which train.compile replaces by compiled_math())."""
    return triton_math() if runs_cuda_kernels("lm_loss", choice, device, "the PyTorch chunk math") else EAGER


def _add_outer_(acc_VD: torch.Tensor, grad_Vc: torch.Tensor, h_cD: torch.Tensor, first: bool) -> None:
    """acc_VD (fp32) += grad_Vc @ h_cD with the products of the compute dtype summed in fp32; the first chunk's GEMM
    writes acc_VD (a GEMM without an input: what acc_VD held is never read, so it needs no zero fill)."""
    if grad_Vc.dtype != acc_VD.dtype and not acc_VD.is_cuda:
        # no mixed-dtype GEMM on the CPU: a product of two bf16 (fp16) values is exact in fp32, so the same sums
        grad_Vc, h_cD = grad_Vc.float(), h_cD.float()
    if grad_Vc.dtype == acc_VD.dtype:
        if first:
            torch.mm(grad_Vc, h_cD, out=acc_VD)
        else:
            acc_VD.addmm_(grad_Vc, h_cD)
    elif first:  # cuBLAS: a bf16 GEMM with its fp32 output (PyTorch >= 2.8)
        torch.mm(grad_Vc, h_cD, out_dtype=torch.float32, out=acc_VD)
    else:  # cuBLAS: a bf16 GEMM accumulating into the fp32 output
        torch.addmm(acc_VD, grad_Vc, h_cD, out_dtype=torch.float32, out=acc_VD)


def _scaled(grad: torch.Tensor | None, scale: torch.Tensor, math: ChunkMath = EAGER) -> torch.Tensor | None:
    """grad * scale computed in fp32 and rounded once to grad's dtype, in row blocks of at most the chunk budget
    (three passes over each block); a bf16 grad through math.scaled_bf16 where the math has it (one pass)."""
    if grad is None or grad.dtype == torch.float32:
        return None if grad is None else grad * scale
    if grad.dtype == torch.bfloat16 and math.scaled_bf16 is not None:
        return math.scaled_bf16(grad, scale)
    out = torch.empty_like(grad)
    rows = max(1, LOGITS_BYTES_PER_CHUNK // (4 * grad.shape[1]))
    for r0 in range(0, grad.shape[0], rows):
        out[r0:r0 + rows] = grad[r0:r0 + rows].float() * scale
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, chunk: int,
                math: ChunkMath) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[:2]
        N = h_ND.shape[0]
        grad_h_ND = torch.empty(h_ND.shape, dtype=h_ND.dtype, device=h_ND.device) if want_h else None
        grad_w_VD = torch.empty(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for n0 in range(0, N, chunk):
            h_cD = h_ND[n0:n0 + chunk]
            loss_c, grad_cV = math.loss_and_grad(F.linear(h_cD, weight_VD), targets_N[n0:n0 + chunk], 1.0 / N)
            loss += loss_c
            if want_h:
                torch.mm(grad_cV, weight_VD, out=grad_h_ND[n0:n0 + chunk])
            if want_w:
                _add_outer_(grad_w_VD, grad_cV.t(), h_cD, first=n0 == 0)
            del grad_cV  # freed before the next chunk's logits are allocated
        ctx.save_for_backward(grad_h_ND, None if grad_w_VD is None else grad_w_VD.to(weight_VD.dtype))
        ctx.math = math
        return loss / N

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        return _scaled(grad_h_ND, grad_loss, ctx.math), _scaled(grad_w_VD, grad_loss, ctx.math), None, None, None


def linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                         chunk: int | None = None, math: ChunkMath = EAGER) -> torch.Tensor:
    """Mean token cross-entropy (fp32 scalar) of the logits h_ND @ weight_VD^T (in h's dtype, as nn.Linear) at
    targets_N (token ids in [0, V)), differentiable in h and the weight, without materialising the [N, V]
    logits. chunk: tokens per chunk (default: chunk_tokens(V, math.logits_bytes)). math: EAGER, compiled_math()
    or triton_math()."""
    if h_ND.dim() != 2 or targets_N.shape != h_ND.shape[:1]:
        raise ValueError(f"linear_cross_entropy takes h [N, D] and targets [N], got h {tuple(h_ND.shape)} and "
                         f"targets {tuple(targets_N.shape)}; flatten the batch and sequence dims of both")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk}: tokens per chunk must be >= 1 (None derives it from the vocab size)")
    chunk = chunk or chunk_tokens(weight_VD.shape[0], math.logits_bytes)
    if torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad):
        return _LinearCrossEntropy.apply(h_ND, weight_VD, targets_N, chunk, math)
    loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
    with torch.no_grad():
        for n0 in range(0, h_ND.shape[0], chunk):
            loss += math.loss(F.linear(h_ND[n0:n0 + chunk], weight_VD), targets_N[n0:n0 + chunk])
    return loss / h_ND.shape[0]
