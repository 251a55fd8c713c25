"""The two elementwise ends of KDA's chunked call, in PyTorch: the specification that
moontrain.model.kda.gate_norm_kernel's two Triton kernels match.

Legend as moontrain.model.kda.dqkg: B batch, T tokens, H heads, K key head dim, C chunk length (64); f the raw
forget input, A_log [H] and dt_bias [H * K] the gate's parameters, lb the gate's lower bound.

Forward (kda_gate_norm_reference), before fla's stages:
    qn = q / sqrt(|q|^2 + eps), q_rstd = 1 / sqrt(|q|^2 + eps)          per token and head; k likewise
    gate = lb sigmoid(exp(A_log) (f + dt_bias))    (lb given; else -exp(A_log) softplus(f + dt_bias))
    g = (cumulative sum of gate within each chunk) / ln 2                fp32, the log2 units fla's stages take
Backward (kda_gate_norm_backward_reference), after fla's intra-chunk stage, given dq, dk (the gradients of qn,
kn) and dg (what fla's stages return for g: its gradient divided by ln 2, the cumulative gate's in nats):
    dgate = reverse cumulative sum of dg within each chunk
    df = dgate * dgate/dx at x = f + dt_bias,  ddt_bias = sum over tokens of df,  dA_log = sum of dgate * dgate/dA_log
    dq_in = q_rstd (dq - (dq . qn) qn)                                 with qn as stored (q's dtype); dk_in likewise
fla's chunk_kda does these in three launches forward (two L2 norms, gate + cumsum) and six backward (reverse
cumsum, gate, its two partial sums, two L2 norms); the kernels do each end in one pass over the tokens.
tests/moontrain/model/kda/test_gate_norm.py checks the backward against autograd through the forward.

Contract: H == HV, C = 64, K a power of two in [32, 256]; packed documents as fla (B = 1, cu_seqlens,
chunk_indices rows (sequence, chunk in it), rows with a negative sequence skipped): chunks restart at each
sequence's start. q, k, f may be strided over tokens (a column slice of the projection) with heads of K
contiguous elements; outputs freshly allocated, tokens outside every listed chunk unwritten by the kernels
(zero here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moontrain.model.kda.dqkg import chunk_rows, prepare_chunk_indices

L2_EPS = 1e-6  # q / sqrt(|q|^2 + eps), as fla's l2norm

FORWARD_OUTPUTS = ("qn", "q_rstd", "kn", "k_rstd", "g")
BACKWARD_OUTPUTS = ("dq", "dk", "df", "dA_log", "ddt_bias")


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def kda_gate(f_BTHK: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g <= 0 (fp32, or fp64 for fp64 inputs): lower_bound * sigmoid(exp(A_log)
    (f + dt_bias)) when bounded, else -exp(A_log) * softplus(f + dt_bias). dt_bias: H * K values. The PyTorch
    KDA's (moontrain.model.kda.ops.kda) and the forward end's."""
    H, K = f_BTHK.shape[-2:]
    x = at_least_fp32(f_BTHK) + at_least_fp32(dt_bias_HK).view(H, K)
    a = at_least_fp32(A_log_H).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def kda_gate_norm_reference(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor,
                            dt_bias: torch.Tensor, *, lower_bound: float | None,
                            cu_seqlens: torch.Tensor | None = None,
                            chunk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(qn, q_rstd, kn, k_rstd, g): the module docstring's forward; qn, kn in q's dtype, q_rstd, k_rstd
    [B, T, H] and g [B, T, H, K] in fp32 (fp64 for fp64 inputs)."""
    validate(q, k, f, A_log, dt_bias, cu_seqlens)
    p = torch.promote_types(q.dtype, torch.float32)

    def norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.to(p).square().sum(-1) + L2_EPS)
        return (x.to(p) * rstd.unsqueeze(-1)).to(x.dtype), rstd

    qn, q_rstd = norm(q)
    kn, k_rstd = norm(k)
    g = _chunk_cumsum(kda_gate(f, A_log.to(p), dt_bias.to(p), lower_bound), cu_seqlens, chunk_indices, reverse=False)
    return qn, q_rstd, kn, k_rstd, g / math.log(2)


def kda_gate_norm_backward_reference(dq: torch.Tensor, dk: torch.Tensor, dg: torch.Tensor, qn: torch.Tensor,
                                     q_rstd: torch.Tensor, kn: torch.Tensor, k_rstd: torch.Tensor, f: torch.Tensor,
                                     A_log: torch.Tensor, dt_bias: torch.Tensor, *, lower_bound: float | None,
                                     cu_seqlens: torch.Tensor | None = None,
                                     chunk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(dq_in, dk_in, df, dA_log, ddt_bias): the module docstring's backward; dq_in, dk_in in qn's dtype, df in
    f's, dA_log and ddt_bias in their parameters' shapes, in fp32 (fp64 for fp64 inputs)."""
    validate(qn, kn, f, A_log, dt_bias, cu_seqlens)
    p = torch.promote_types(dq.dtype, torch.float32)

    def norm_backward(d: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        y = y.to(p)
        d = d.to(p)
        return (rstd.to(p).unsqueeze(-1) * (d - (d * y).sum(-1, keepdim=True) * y)).to(qn.dtype)

    dgate = _chunk_cumsum(dg.to(p), cu_seqlens, chunk_indices, reverse=True)
    f_ = f.detach().to(p).requires_grad_()
    A_ = A_log.detach().to(p).requires_grad_()
    b_ = dt_bias.detach().to(p).requires_grad_()
    with torch.enable_grad():
        df, dA, db = torch.autograd.grad(kda_gate(f_, A_, b_, lower_bound), (f_, A_, b_), dgate)
    return (norm_backward(dq, qn, q_rstd), norm_backward(dk, kn, k_rstd), df.to(f.dtype), dA.view_as(A_log),
            db.view_as(dt_bias))


def _chunk_cumsum(x: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                  reverse: bool) -> torch.Tensor:
    """The cumulative sum of x [B, T, H, K] along tokens within each listed chunk (from its last token back when
    reverse); tokens outside every listed chunk are zero."""
    B, T = x.shape[:2]
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    _, batch_R, tok_RC, valid_RC = chunk_rows(B, T, cu_seqlens, chunk_indices, x.device)
    rows = x[batch_R[:, None], tok_RC] * valid_RC[..., None, None]  # [R, C, H, K]
    sums = rows.flip(1).cumsum(1).flip(1) if reverse else rows.cumsum(1)
    out = torch.zeros_like(x)
    out[batch_R[:, None].expand_as(tok_RC)[valid_RC], tok_RC[valid_RC]] = sums[valid_RC]
    return out


def validate(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             cu_seqlens: torch.Tensor | None) -> None:
    """The contract of the module docstring, with errors that name the value and the fix."""
    if k.dim() != 4:
        raise ValueError(f"kda_gate_norm: k must be [B, T, H, K], got {tuple(k.shape)}")
    B, _, H, K = k.shape
    for name, x in (("q", q), ("f", f)):
        if x.shape != k.shape:
            raise ValueError(f"kda_gate_norm: {name} has shape {tuple(x.shape)}, expected k's {tuple(k.shape)} "
                             "(grouped value heads are not supported)")
    if K < 32 or K > 256 or K & (K - 1):
        raise ValueError(f"kda_gate_norm: K={K}; the head dim must be a power of two in [32, 256]")
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(f"kda_gate_norm: A_log has {A_log.numel()} and dt_bias {dt_bias.numel()} elements; "
                         f"expected {H} and {H * K} (one per head, one per head channel)")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"kda_gate_norm: packed documents (cu_seqlens) need batch 1, got B={B}; flatten the "
                         "batch to [1, B*T, ...] first")


def random_stage_inputs(B: int, T: int, H: int, K: int, dtype: torch.dtype, device: str, seed: int,
                        lower_bound: float | None = -5.0, cu_seqlens: torch.Tensor | None = None,
                        chunk_indices: torch.Tensor | None = None) -> tuple[dict, dict]:
    """Random inputs of both ends at a KDA layer's scales, as keyword arguments (forward, backward without the
    forward's outputs): q, k, f N(0, 1) in dtype; A_log = log U(1, 16), dt_bias N(-4, 1) (fp32); dq, dk, dg
    N(0, 1) in fp32 (the intra stage's gradients)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dt)

    q, k, f = (rnd(B, T, H, K, dt=dtype) for _ in range(3))
    A_log = torch.empty(H, device=device).uniform_(1, 16, generator=gen).log()
    dt_bias = rnd(H * K) - 4
    grad_dtype = torch.promote_types(dtype, torch.float32)
    dq, dk, dg = (rnd(B, T, H, K, dt=grad_dtype) for _ in range(3))
    common = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                  chunk_indices=chunk_indices)
    return dict(q=q, k=k, f=f, **common), dict(dq=dq, dk=dk, dg=dg, f=f, **common)
