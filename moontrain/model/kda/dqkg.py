"""KDA's chunked backward, the WY / inter-chunk stage (fla-core's chunk_kda_bwd_wy_dqkg_fused): its PyTorch
specification (moontrain.model.kda.dqkg_kernel: the Triton kernels that match it).

Legend: B batch, T tokens, H heads, K key head dim, V value head dim, C chunk length (BT = 64), R rows of
the chunk list (h and dh are indexed by them).

Per chunk (rows t of the chunk, g the chunk-local cumulative log2 gate, gn its value at the chunk's last
row, A the chunk's [C, C] lower-triangular WY inverse as stored, h / dh the state at the chunk's start and
the gradient of the state at its end, dv the gradient of v_new = u - w h):
    dq  = scale 2^g * (do h^T)                    dk_h = 2^(gn - g) * (v_new dh^T)      dw = -(dv h^T)
    kg  = k 2^g           dkgb = A^T dw            dk = dk_h + beta 2^g * dkgb
    dg  = q dq - k dk_h + kg beta dkgb + [t last] (2^gn sum_v h dh + sum_t k dk_h)   (before fla's reverse cumsum)
    dvb = A^T dv          dv2 = beta dvb            db = sum_v dvb v + sum_k dkgb kg
    dA  = -tril_1(A^T (tril_1(dv v^T + dw kg^T) diag(beta)) A^T)   (tril_1: strictly lower, valid rows/cols)
These are the gradients of o = (q scale 2^g) h + Aqk v_new and of the chunk's end state with respect to q,
k, v, beta, g and the strictly lower matrix A inverts, with Aqk and that matrix held fixed (the intra-chunk
kernel adds their part); tests/moontrain/model/kda/test_dqkg.py checks exactly that through autograd.

Contract: H == HV (no GVA), state_v_first=False (h, dh [B, R, H, K, V]), C = 64, K and V powers of two in
[32, 256]; packed documents as fla: B = 1, cu_seqlens, chunk_indices rows (sequence, chunk in it), rows
with a negative sequence (fla's use_graph padding) skipped; outputs freshly allocated, tokens outside every
listed chunk left unwritten (as fla).
"""

from __future__ import annotations

import math

import torch

CHUNK = 64  # fla's KDA chunk length (BT)
STAGE_OUTPUTS = ("dq", "dk", "dv2", "db", "dg", "dA")


def chunk_rows(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_R, batch_R, tok_RC, valid_RC) of the listed chunks: the chunk-list row (h / dh index), batch
    row, token index of each chunk row (clamped into [0, T)) and whether it lies inside its sequence."""
    C = CHUNK
    if cu_seqlens is None:
        NT = math.ceil(T / C)
        row_R = torch.arange(B * NT, device=device)
        batch_R = row_R // NT
        start_R = (row_R % NT) * C
        end_R = torch.full_like(row_R, T)
    else:
        ci = chunk_indices.to(device=device, dtype=torch.long)
        keep = ci[:, 0] >= 0
        row_R = torch.arange(ci.shape[0], device=device)[keep]
        seq_R, chunk_R = ci[keep, 0], ci[keep, 1]
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        batch_R = torch.zeros_like(row_R)
        start_R = cu[seq_R] + chunk_R * C
        end_R = cu[seq_R + 1]
    tok_RC = start_R[:, None] + torch.arange(C, device=device)
    valid_RC = tok_RC < end_R[:, None]
    return row_R, batch_R, tok_RC.clamp(max=T - 1), valid_RC


def kda_dqkg_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
                       dv: torch.Tensor, scale: float | None = None, state_v_first: bool = False,
                       cu_seqlens: torch.Tensor | None = None, chunk_size: int = CHUNK,
                       chunk_indices: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None,
                       use_graph: bool = False) -> tuple[torch.Tensor, ...]:
    """The stage's specification, kda_dqkg's arguments and outputs (dq, dk, dv2, db, dg, dA): the module
    docstring's formulas in fp32 (fp64 for fp64 inputs), all chunks at once. Tokens outside every listed
    chunk are zero here (the kernel leaves them unwritten)."""
    B, T, H, K, V = *k.shape, v.shape[-1]
    validate(q, k, v, g, beta, A, h, state_v_first, cu_seqlens, chunk_size, chunk_indices)
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    scale = K ** -0.5 if scale is None else scale
    f = torch.promote_types(torch.float32, q.dtype)
    row_R, batch_R, tok_RC, valid_RC = chunk_rows(B, T, cu_seqlens, chunk_indices, q.device)
    m_R1C1 = valid_RC[:, None, :, None].to(f)

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, X] -> [R, H, C, X], zero outside the sequence
        return x[batch_R[:, None], tok_RC].to(f).transpose(1, 2) * m_R1C1

    q_, k_, g_, A_ = rows(q), rows(k), rows(g), rows(A)
    v_, vn_, do_, dv_ = rows(v), rows(v_new), rows(do), rows(dv)
    beta_ = rows(beta.unsqueeze(-1))  # [R, H, C, 1]
    h_ = h.reshape(-1, H, K, V)[row_R].to(f)
    dh_ = dh.reshape(-1, H, K, V)[row_R].to(f)
    last_R = valid_RC.sum(-1) - 1
    is_last = (torch.arange(CHUNK, device=q.device) == last_R[:, None])[:, None, :, None].to(f)
    gn = (g_ * is_last).sum(-2, keepdim=True)  # [R, H, 1, K]
    At = A_.transpose(-1, -2)

    dq = scale * torch.exp2(g_) * (do_ @ h_.transpose(-1, -2))
    dk_h = torch.exp2(gn - g_) * m_R1C1 * (vn_ @ dh_.transpose(-1, -2))
    dw = -(dv_ @ h_.transpose(-1, -2))
    kg = k_ * torch.exp2(g_)
    dkgb = At @ dw
    dgk = torch.exp2(gn) * (h_ * dh_).sum(-1).unsqueeze(-2) + (k_ * dk_h).sum(-2, keepdim=True)
    dg = q_ * dq - k_ * dk_h + kg * dkgb * beta_ + is_last * dgk
    dk = dk_h + dkgb * torch.exp2(g_) * beta_
    dvb = At @ dv_
    dv2 = dvb * beta_
    db = (dvb * v_).sum(-1) + (dkgb * kg).sum(-1)  # [R, H, C]
    idx = torch.arange(CHUNK, device=q.device)
    lower = (idx[:, None] > idx[None, :]) & valid_RC[:, :, None] & valid_RC[:, None, :]  # [R, C, C]
    lower = lower[:, None].to(f)
    dA = (dv_ @ v_.transpose(-1, -2) + dw @ kg.transpose(-1, -2)) * lower * beta_.transpose(-1, -2)
    dA = -(At @ (dA @ At)) * lower

    def scatter(x_RHCX: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(like.shape, dtype=dtype, device=like.device)
        val = x_RHCX.transpose(1, 2)[valid_RC]
        out[batch_R[:, None].expand_as(tok_RC)[valid_RC], tok_RC[valid_RC]] = val.reshape(-1, *like.shape[2:]).to(dtype)
        return out

    dv2_dtype = v.dtype if f == torch.float32 else f  # fla's dv2 is in v's dtype
    return (scatter(dq, q, f), scatter(dk, k, f), scatter(dv2, v, dv2_dtype), scatter(db.unsqueeze(-1), beta, f),
            scatter(dg, g, f), scatter(dA, A, f))


def prepare_chunk_indices(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[R, 2] rows (sequence, chunk in it) of every chunk of the packed sequences, in order (fla's
    prepare_chunk_indices; one host sync)."""
    num_chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK
    seq_R = torch.repeat_interleave(torch.arange(num_chunks.numel(), device=cu_seqlens.device), num_chunks)
    first_R = torch.repeat_interleave(num_chunks.cumsum(0) - num_chunks, num_chunks)
    chunk_R = torch.arange(seq_R.numel(), device=cu_seqlens.device) - first_R
    return torch.stack([seq_R, chunk_R], 1).to(cu_seqlens.dtype)


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              A: torch.Tensor, h: torch.Tensor, state_v_first: bool, cu_seqlens: torch.Tensor | None,
              chunk_size: int, chunk_indices: torch.Tensor | None) -> None:
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"kda_dqkg: k must be [B, T, H, K] and v [B, T, HV, V], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    if HV != H:
        raise ValueError(f"kda_dqkg: v has {HV} heads and k {H}; grouped value heads (GVA) are not supported, "
                         "use fla's chunk_kda_bwd_wy_dqkg_fused for HV != H")
    if state_v_first:
        raise ValueError("kda_dqkg: state_v_first=True is not supported; lay h and dh out as [B, NT, H, K, V] "
                         "(state_v_first=False)")
    if chunk_size != CHUNK:
        raise ValueError(f"kda_dqkg: chunk_size={chunk_size}; the kernel takes chunk_size={CHUNK} (fla's default)")
    for name, d in (("K", K), ("V", V)):
        if d < 32 or d > 256 or d & (d - 1):
            raise ValueError(f"kda_dqkg: {name}={d}; head dims must be powers of two in [32, 256] (the "
                             "smallest tile is 32 wide)")
    if q.shape != k.shape or g.shape != k.shape or beta.shape != (B, T, H) or A.shape != (B, T, H, CHUNK):
        raise ValueError(f"kda_dqkg: shapes q {tuple(q.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}, "
                         f"A {tuple(A.shape)} do not match k {tuple(k.shape)}; expected q, g [B, T, H, K], "
                         f"beta [B, T, H], A [B, T, H, {CHUNK}]")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"kda_dqkg: packed documents (cu_seqlens) need batch 1, got B={B}; flatten the batch "
                         "to [1, B*T, ...] first")
    if cu_seqlens is None:
        num_rows = B * math.ceil(T / CHUNK)
    else:
        num_rows = chunk_indices.shape[0] if chunk_indices is not None else None
    if h.dim() != 5 or h.shape[2:] != (H, K, V) or (num_rows is not None and h.shape[0] * h.shape[1] != num_rows):
        raise ValueError(f"kda_dqkg: h has shape {tuple(h.shape)}, expected [B, NT, {H}, {K}, {V}] with one "
                         f"state per listed chunk ({num_rows} chunks)")


def random_stage_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: str, seed: int,
                 cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                 gate: float = 5.0) -> dict:
    """Random inputs of the stage at fla's scales, as keyword arguments: q, k unit rows; v, v_new, do, dv,
    h N(0, 1), dh N(0, 0.01); beta U(0, 1); g (fp32) the chunk-local cumsum of per-token log2 gates in
    [-gate log2(e), 0] (most near 0: -gate u^3); A per chunk (I + Lm)^-1 with Lm strictly lower N(0, 0.01),
    stored as fla stores it (row t holds its chunk row, zeros above the diagonal). Rows of chunk_indices
    with a negative sequence get random states too (the kernel must not read them)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)

    C = CHUNK
    row_R, batch_R, tok_RC, valid_RC = chunk_rows(B, T, cu_seqlens, chunk_indices, torch.device(device))
    b_RC = batch_R[:, None].expand_as(tok_RC)
    q, k = unit(rnd(B, T, H, K)), unit(rnd(B, T, H, K))
    v, v_new, do, dv = (rnd(B, T, H, V) for _ in range(4))
    beta = torch.rand(B, T, H, generator=gen, device=device)
    raw = -torch.rand(B, T, H, K, generator=gen, device=device) ** 3 * gate * math.log2(math.e)
    g = torch.zeros(B, T, H, K, device=device)
    g[b_RC[valid_RC], tok_RC[valid_RC]] = (raw[batch_R[:, None], tok_RC] * valid_RC[..., None, None]).cumsum(1)[valid_RC]
    A_RHCC = torch.linalg.inv(torch.eye(C, device=device) + torch.tril(rnd(len(row_R), H, C, C), -1) * 0.1)
    A = torch.zeros(B, T, H, C, device=device)
    A[b_RC[valid_RC], tok_RC[valid_RC]] = A_RHCC.transpose(1, 2)[valid_RC]
    state_rows = B * math.ceil(T / C) if cu_seqlens is None else chunk_indices.shape[0]
    h = rnd(state_rows, H, K, V).view(B if cu_seqlens is None else 1, -1, H, K, V)
    dh = rnd(*h.shape) * 0.1
    out = dict(q=q, k=k, v=v, v_new=v_new, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv)
    return {**{n: x.to(dtype) for n, x in out.items()}, "g": g, "scale": K ** -0.5, "cu_seqlens": cu_seqlens,
            "chunk_indices": chunk_indices}
