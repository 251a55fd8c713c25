"""The router's routing step as one Triton kernel each way (kernels.router picks it; moontrain.model.router's
PyTorch math is the specification).

Legend: s tokens, D hidden, E experts, K top-k, BS tokens per program.

    logits = x w^T (fp32 accumulation of the bf16 products)      scores = sigmoid(logits)
    topk = the K largest of scores + bias (+ skew), largest first  a = scores[topk]
    weights = a / sum_k a * scaling                                counts[e] += tokens that chose e
    backward (g = dL/dweights):  gq = g * scaling   ga = gq / b - sum_k gq (a / b) / b   (b = sum_k a)
                                 dlogits[topk] = ga (1 - a) a, 0 elsewhere

RoutedScores runs this for bf16 activations and bf16 router weights (the compute copies the mixed precision
hands the router on a GPU): the logits GEMM (one cuBLAS call, fp32 output), then one kernel that reads the
logits, selects, weights and counts; backward one kernel that writes the logits' gradient, split into two bf16
terms [g_hi | g_lo] (g_hi = bf16(g), g_lo = bf16(g - g_hi), within 2^-16 of g, as RouterLogits splits it), and
two GEMMs on them (grad_x of K = 2E in bf16; grad_w with fp32 output, the halves added, rounded to bf16 as the
weight's autograd cast rounds it). On a GPU the PyTorch route launches ~20 kernels forward and ~21 backward per
layer and pass (the weight's cast and split, sigmoid, the bias add, topk, gather, the normalisation, the count,
and their backward nodes); this one 4 and 6 (the mean-free input sum's two included), ~465 fewer per k3_small
pass, where the step's GPU waits for the host's launches (docs/performance.md).

Selection: K rounds of a row maximum over the experts not yet taken, the lowest expert index among equal
values (torch.topk leaves ties' order unspecified; away from ties the two agree, bitwise on the GPU: the
scores are 1 / (1 + exp(-x)) with libdevice's exp and a correctly rounded division, torch's sigmoid). NaN
selection values count as -inf, so every token still gets K distinct experts in range (a non-finite step
is skipped by the trainer).
Numerics against the specification: scores, selection and a bitwise (as above); b sums the K chosen scores in
selection order, so weights and gradients differ from torch's reductions in the last bits (fp32).
In Triton's interpreter (the CPU tests) exp is numpy's and bf16 casts truncate; the tests' bounds allow it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moontrain.model.bf16_mm import mm

# tokens per program: BS x BLOCK_E fp32 values a tensor in registers, at most 4,096 (sm90, 4 warps: 72 registers at
# E = 64 with 16 tokens; 228, no spills, at E = 384 with 8; 16 at 384 spills; Triton's ptxas, no GPU needed)
MAX_ROWS, TILE_ELEMENTS = 16, 4096


@triton.jit
def _sigmoid(x, HW: tl.constexpr):
    if HW:
        return libdevice.div_rn(1.0, 1.0 + libdevice.exp(-x))
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _div(a, b, HW: tl.constexpr):
    if HW:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _route_fwd_kernel(logit_ptr, bias_ptr, skew_ptr, weight_ptr, topk_ptr, chosen_ptr, count_ptr, S, scaling,
                      E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      BS: tl.constexpr, HAS_SKEW: tl.constexpr, COUNT: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0) * BS + tl.arange(0, BS)
    cols = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < S
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    logit = tl.load(logit_ptr + rows[:, None] * E + cols[None, :], mask=ok, other=0.0)
    score = _sigmoid(logit, HW)
    select = score + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_SKEW:
        select = select + tl.load(skew_ptr + cols, mask=col_ok, other=0.0)[None, :]
    select = tl.where(select == select, select, float("-inf"))  # NaN: never above a number
    taken = cols[None, :] >= E  # the padding columns are never candidates
    a_sk = tl.zeros([BS, BLOCK_K], dtype=tl.float32)
    idx_sk = tl.zeros([BS, BLOCK_K], dtype=tl.int64)
    total = tl.zeros([BS], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), select), axis=1)
        hit = (~taken) & (select == best[:, None])
        idx = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        pick = cols[None, :] == idx[:, None]
        a = tl.sum(tl.where(pick, score, 0.0), axis=1)
        taken = taken | pick
        a_sk = tl.where(ks[None, :] == k, a[:, None], a_sk)
        idx_sk = tl.where(ks[None, :] == k, idx[:, None].to(tl.int64), idx_sk)
        total = total + a
    total = tl.where(row_ok, total, 1.0)  # padding rows: no 0 / 0
    w_sk = _div(a_sk, total[:, None], HW) * scaling
    out = rows[:, None] * K + ks[None, :]
    out_ok = row_ok[:, None] & (ks[None, :] < K)
    tl.store(weight_ptr + out, w_sk, mask=out_ok)
    tl.store(topk_ptr + out, idx_sk, mask=out_ok)
    tl.store(chosen_ptr + out, a_sk, mask=out_ok)
    if COUNT:
        chose = taken & ok
        tl.atomic_add(count_ptr + cols, tl.sum(chose.to(tl.int64), axis=0), mask=col_ok)


@triton.jit
def _route_bwd_kernel(grad_ptr, chosen_ptr, topk_ptr, split_ptr, S, scaling,
                      E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      BS: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0) * BS + tl.arange(0, BS)
    cols = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < S
    k_ok = row_ok[:, None] & (ks[None, :] < K)
    at = rows[:, None] * K + ks[None, :]
    g = tl.load(grad_ptr + at, mask=k_ok, other=0.0)
    a = tl.load(chosen_ptr + at, mask=k_ok, other=0.0)
    idx = tl.load(topk_ptr + at, mask=k_ok, other=BLOCK_E)
    total = tl.zeros([BS], dtype=tl.float32)
    for k in tl.static_range(K):
        total = total + tl.sum(tl.where(ks[None, :] == k, a, 0.0), axis=1)
    gq = g * scaling
    b = tl.where(row_ok, total, 1.0)[:, None]  # padding rows: no 0 / 0
    ga = _div(gq, b, HW) + tl.sum(-gq * _div(_div(a, b, HW), b, HW), axis=1)[:, None]
    ga = ga * (1.0 - a) * a
    dense = tl.zeros([BS, BLOCK_E], dtype=tl.float32)
    for k in tl.static_range(K):
        gk = tl.sum(tl.where(ks[None, :] == k, ga, 0.0), axis=1)
        ik = tl.sum(tl.where(ks[None, :] == k, idx, 0), axis=1)
        dense = tl.where(cols[None, :] == ik[:, None], gk[:, None], dense)
    hi = dense.to(tl.bfloat16)
    lo = (dense - hi.to(tl.float32)).to(tl.bfloat16)
    ok = row_ok[:, None] & (cols[None, :] < E)
    base = split_ptr + rows[:, None] * (2 * E) + cols[None, :]
    tl.store(base, hi, mask=ok)
    tl.store(base + E, lo, mask=ok)


def _meta(E: int, K: int) -> dict[str, int]:
    block_e = triton.next_power_of_2(E)
    return dict(E=E, K=K, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(K),
                BS=max(1, min(MAX_ROWS, TILE_ELEMENTS // block_e)))


class RoutedScores(torch.autograd.Function):
    """(weights_sK fp32, topk_sK int64) of bf16 x_sD and bf16 w_ED; counts_E (int64) gains each expert's
    tokens when given."""

    @staticmethod
    def forward(ctx, x_sD: torch.Tensor, w_ED: torch.Tensor, bias_E: torch.Tensor, skew_E: torch.Tensor | None,
                counts_E: torch.Tensor | None, K: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        s, E = x_sD.shape[0], w_ED.shape[0]
        logits_sE = mm(x_sD, w_ED.t(), torch.float32)
        weights_sK = torch.empty(s, K, dtype=torch.float32, device=x_sD.device)
        topk_sK = torch.empty(s, K, dtype=torch.int64, device=x_sD.device)
        chosen_sK = torch.empty(s, K, dtype=torch.float32, device=x_sD.device)
        meta = _meta(E, K)
        _route_fwd_kernel[(triton.cdiv(s, meta["BS"]),)](
            logits_sE, bias_E, skew_E, weights_sK, topk_sK, chosen_sK, counts_E, s, float(scaling),
            HAS_SKEW=skew_E is not None, COUNT=counts_E is not None, HW=x_sD.is_cuda, **meta)
        ctx.save_for_backward(x_sD, w_ED, topk_sK, chosen_sK)
        ctx.scaling = float(scaling)
        ctx.mark_non_differentiable(topk_sK)
        return weights_sK, topk_sK

    @staticmethod
    def backward(ctx, grad_sK: torch.Tensor, _grad_topk: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x_sD, w_ED, topk_sK, chosen_sK = ctx.saved_tensors
        s, E, K = x_sD.shape[0], w_ED.shape[0], topk_sK.shape[1]
        split_s2E = torch.empty(s, 2 * E, dtype=torch.bfloat16, device=x_sD.device)
        meta = _meta(E, K)
        _route_bwd_kernel[(triton.cdiv(s, meta["BS"]),)](
            grad_sK.float().contiguous(), chosen_sK, topk_sK, split_s2E, s, ctx.scaling, HW=x_sD.is_cuda, **meta)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # g_hi w + g_lo w, one GEMM of K = 2E
            grad_x = mm(split_s2E, torch.cat([w_ED, w_ED]), x_sD.dtype)
        if ctx.needs_input_grad[1]:
            out_2ED = mm(split_s2E.t(), x_sD, torch.float32)
            grad_w = (out_2ED[:E] + out_2ED[E:]).to(w_ED.dtype)
        return grad_x, grad_w, None, None, None, None, None


MAX_EXPERTS = 512  # BLOCK_E: one program holds a token's scores over every expert


def unsupported(num_experts: int, topk: int, *, gemm: str = "split_bf16", groups: int = 1,
                seq_aux_loss_coef: float = 0.0) -> str | None:
    """Why a router of this shape cannot run these kernels (None: it can): kernels.router=auto then runs the
    PyTorch math, kernels.router=triton is refused with the reason."""
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} experts (the kernel holds at most {MAX_EXPERTS} per token)"
    if not 1 <= topk <= num_experts:
        return f"top-{topk} of {num_experts} experts"
    if gemm != "split_bf16":
        return f"kernels.router_gemm={gemm} (the kernels take split_bf16's bf16 GEMMs)"
    if groups > 1:
        return f"model.num_expert_groups={groups} (group-limited routing)"
    if seq_aux_loss_coef > 0:
        return f"model.seq_aux_loss_coef={seq_aux_loss_coef} (the sequence aux loss reads every score)"
    return None


def routed_scores(x_sD: torch.Tensor, w_ED: torch.Tensor, bias_E: torch.Tensor, skew_E: torch.Tensor | None,
                  counts_E: torch.Tensor | None, K: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoutedScores for bf16 x_sD [s, D] and w_ED [E, D] (the module docstring); bias_E, skew_E fp32 [E]."""
    if x_sD.dtype != torch.bfloat16 or w_ED.dtype != torch.bfloat16:
        raise ValueError(f"routed_scores: x and w must be bf16 (got {x_sD.dtype}, {w_ED.dtype}); "
                         "kernels.router=torch runs other dtypes")
    E = w_ED.shape[0]
    if not 1 <= K <= E or E > MAX_EXPERTS:
        raise ValueError(f"routed_scores: top-{K} of {E} experts; the kernel takes 1 <= K <= E <= {MAX_EXPERTS} "
                         "(kernels.router=torch runs any)")
    for name, t in (("bias_E", bias_E), ("skew_E", skew_E)):
        if t is not None and (t.dtype != torch.float32 or t.shape != (E,) or not t.is_contiguous()):
            raise ValueError(f"routed_scores: {name} must be a contiguous fp32 [{E}], got {t.dtype} {tuple(t.shape)}")
    if counts_E is not None and (counts_E.dtype != torch.int64 or counts_E.shape != (E,)):
        raise ValueError(f"routed_scores: counts_E must be int64 [{E}], got {counts_E.dtype} {tuple(counts_E.shape)}")
    return RoutedScores.apply(x_sD.contiguous(), w_ED.contiguous(), bias_E, skew_E, counts_E, K, scaling)
