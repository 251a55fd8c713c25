"""The specification of moontrain.model.kda.intra_fwd_kernel: KDA's forward intra-chunk stage (fla-core's
chunk_kda_fwd_intra with safe_gate and disable_recompute: its three launches, composed).

Legend as moontrain.model.kda.intra: B batch, T tokens, H heads, K key and V value head dims, C chunk length (64),
g the chunk-local cumulative log2 gate (fp32, non-increasing along a chunk), gn its value at the chunk's last
row. Per chunk and head (rows i, j of the chunk, E_ijc = 2^(g_ic - g_jc)):
    Aqk_ij = scale sum_c q_ic k_jc E_ijc                 (j <= i; zero above)
    L_ij   = beta_i sum_c k_ic k_jc E_ijc                (j < i; zero on and above the diagonal)
    Akk    = (I + L)^-1                                  (unit lower triangular; the WY form's inverse)
    w      = Akk (beta k 2^g)        u = Akk (beta v)      qg = q 2^g        kg = k 2^(gn - g)
The kernel forms the scores on tensor cores in tf32 from factored exponentials, inverts the four 16-row diagonal
blocks of I + L by forward substitution in fp32 and joins them with three tf32 products, and rounds Akk, beta k
and beta v to the inputs' dtype before w and u, as fla does; this reference computes in the inputs' precision, at
least fp32, without those roundings.

Contract: H == HV, C = 64, K and V powers of two in [32, 256]; packed documents as fla (B = 1, cu_seqlens,
chunk_indices rows (sequence, chunk in it), rows with a negative sequence skipped: fla's use_graph padding);
tokens outside every listed chunk are unwritten by the kernel (zero here).
"""

from __future__ import annotations

import functools
import math

import torch

from moontrain.model.kda.dqkg import CHUNK, chunk_rows, prepare_chunk_indices
from moontrain.model.kda.intra import SLAB_ROWS, _rows, random_stage_inputs

STAGE_OUTPUTS = ("w", "u", "qg", "kg", "Aqk", "Akk")


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             cu_seqlens: torch.Tensor | None) -> None:
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"kda_intra_forward: k must be [B, T, H, K] and v [B, T, H, V], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    B, T, H, K = k.shape
    for name, x, want in (("q", q, k.shape), ("g", g, k.shape), ("beta", beta, (B, T, H)),
                          ("v", v, (B, T, H, v.shape[-1]))):
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"kda_intra_forward: {name} has shape {tuple(x.shape)}, expected {tuple(want)} "
                             "(H == HV: grouped value heads are not supported, use fla's chunk_kda_fwd_intra)")
    for name, d in (("K", K), ("V", v.shape[-1])):
        if d < 32 or d > 256 or d & (d - 1):
            raise ValueError(f"kda_intra_forward: {name}={d}; the head dims must be powers of two in [32, 256]")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"kda_intra_forward: packed documents (cu_seqlens) need batch 1, got B={B}; flatten the "
                         "batch to [1, B*T, ...] first")


def kda_intra_forward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, scale: float, *, cu_seqlens: torch.Tensor | None = None,
                                chunk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(w, u, qg, kg, Aqk, Akk) as the module docstring defines them, in the inputs' precision (at least fp32);
    tokens outside every listed chunk zero."""
    validate(q, k, v, g, beta, cu_seqlens)
    B, T, H, K = k.shape
    V = v.shape[-1]
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    f = torch.promote_types(torch.float32, q.dtype)
    _, batch_R, tok_RC, valid_RC = chunk_rows(B, T, cu_seqlens, chunk_indices, q.device)
    idx = torch.arange(CHUNK, device=q.device)
    outs = dict(w=(B, T, H, K), u=(B, T, H, V), qg=(B, T, H, K), kg=(B, T, H, K), Aqk=(B, T, H, CHUNK),
                Akk=(B, T, H, CHUNK))
    outs = {n: torch.zeros(s, dtype=f, device=q.device) for n, s in outs.items()}
    eye = torch.eye(CHUNK, dtype=f, device=q.device)
    for s in range(0, len(batch_R), SLAB_ROWS):
        b_R, tok, valid = batch_R[s:s + SLAB_ROWS], tok_RC[s:s + SLAB_ROWS], valid_RC[s:s + SLAB_ROWS]
        rows = functools.partial(_rows, batch_R=b_R, tok_RC=tok, valid_RC=valid, dtype=f)
        q_, k_, v_, g_, beta_ = rows(q), rows(k), rows(v), rows(g), rows(beta.unsqueeze(-1))  # [R, H, C, X]
        pair = (valid[:, :, None] & valid[:, None, :])[:, None]  # [R, 1, i, j]
        diff = g_[:, :, :, None, :] - g_[:, :, None, :, :]  # [R, H, i, j, K]
        E = torch.exp2(torch.where(pair[..., None] & (idx[:, None] >= idx[None, :])[..., None], diff, -math.inf))
        Aqk = scale * torch.einsum("rhic,rhjc,rhijc->rhij", q_, k_, E)
        L = torch.where(idx[:, None] > idx[None, :], beta_ * torch.einsum("rhic,rhjc,rhijc->rhij", k_, k_, E), 0.0)
        Akk = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
        last = valid.sum(1) - 1  # [R]: the chunk's last row
        gn = g_[torch.arange(len(last), device=q.device), :, last]  # [R, H, K]
        got = dict(w=Akk @ (beta_ * k_ * torch.exp2(g_)), u=Akk @ (beta_ * v_), qg=q_ * torch.exp2(g_),
                   kg=k_ * torch.exp2(gn[:, :, None] - g_), Aqk=Aqk, Akk=Akk)
        for name, x in got.items():
            full = x.transpose(1, 2)[valid]  # [tokens, H, X]
            outs[name][b_R[:, None].expand_as(tok)[valid], tok[valid]] = full
    return tuple(outs[n] for n in STAGE_OUTPUTS)


def on_or_below_diagonal(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                         strict: bool = False) -> torch.Tensor:
    """For chunk matrices laid out [B, T, H, C] (row t of its chunk's matrix at token t): True where column c lies
    on (strict: below) the row's diagonal, each token's row within its chunk counted from its sequence's start."""
    pos = torch.arange(x.shape[1], device=x.device)
    if cu_seqlens is not None:
        pos = pos - cu_seqlens[torch.searchsorted(cu_seqlens, pos, right=True) - 1]
    col, row = torch.arange(CHUNK, device=x.device)[None, :], (pos % CHUNK)[:, None]
    return (col < row if strict else col <= row)[None, :, None, :].expand_as(x)


def random_intra_forward_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: str, seed: int,
                                cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                                gate: float = 5.0, at_bound: bool = False) -> dict:
    """The stage's inputs at fla's scales, as keyword arguments: q, k, beta and g as
    moontrain.model.kda.intra.random_stage_inputs draws them (unit rows, beta U(0, 1) in fp32 as the model passes
    it, g the chunk-local cumsum of log2 gates in [-gate log2(e), 0], or all at the bound with at_bound), v N(0, 1)
    in dtype, scale K^-1/2."""
    x = random_stage_inputs(B, T, H, K, dtype, device, seed, cu_seqlens, chunk_indices, gate, at_bound)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    v = torch.randn(B, T, H, V, generator=gen, device=device).to(dtype)
    return dict(q=x["q"], k=x["k"], v=v, g=x["g"], beta=x["beta"], scale=K ** -0.5, cu_seqlens=cu_seqlens,
                chunk_indices=chunk_indices)
