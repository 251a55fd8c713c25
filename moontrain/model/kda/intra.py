"""KDA's chunked backward, the intra-chunk stage (fla-core's chunk_kda_bwd_intra): its PyTorch specification
(moontrain.model.kda.intra_fla runs fla's kernel for it with 64-wide K-blocks; tests hold both to this).

Legend as moontrain.model.kda.dqkg: B batch, T tokens, H heads, K key head dim, C chunk length (64), g the
chunk-local cumulative log2 gate (fp32, non-increasing along a chunk).

The forward builds two [C, C] matrices per chunk and head from q, k, g and beta:
    Aqk_ij = sum_c q_ic k_jc 2^(g_ic - g_jc)            (j <= i)
    Akk_ij = beta_i sum_c k_ic k_jc 2^(g_ic - g_jc)     (j < i; the strictly lower matrix the WY form inverts)
Given their gradients dAqk (fla's, with the attention scale in it) and dAkk (the dqkg stage's dA), this stage
adds their parts to the gradients of q, k, beta and g that the dqkg stage produced (E_ijc = 2^(g_ic - g_jc)):
    dq_i += sum_{j<=i} dAqk_ij k_j E_ij                  r_i = sum_{j<i} dAkk_ij k_j E_ij
    db_i += sum_c r_ic k_ic                               dk_i += beta_i r_i + t_i
    t_j   = sum_{i>=j} dAqk_ij q_i E_ij + sum_{i>j} dAkk_ij beta_i k_i E_ij
    dg_i += q_i (dq_i's addition) + (beta_i r_i - t_i) k_i   (before fla's reverse cumsum)
tests/moontrain/model/kda/test_intra.py checks these against autograd through the two matrices. Entries of
dAqk above the diagonal and of dAkk on or above it, and columns past a chunk's end, are not read.

Contract: H == HV (no GVA), C = 64, K a power of two in [32, 256], dq/dk/dg/db fp32 (the dqkg stage's
outputs); packed documents as fla (B = 1, cu_seqlens, chunk_indices rows (sequence, chunk in it), rows with a
negative sequence skipped); outputs freshly allocated (fp32), tokens outside every listed chunk unwritten.
"""

from __future__ import annotations

import functools
import math

import torch

from moontrain.model.kda.dqkg import CHUNK, chunk_rows, prepare_chunk_indices

STAGE_OUTPUTS = ("dq", "dk", "db", "dg")
SLAB_ROWS = 32  # chunks per step of the specification's [rows, H, C, C, K] exponent tensor (bounds its memory)


def kda_intra_reference(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        dAqk: torch.Tensor, dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                        db: torch.Tensor, dg: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                        chunk_indices: torch.Tensor | None = None, chunk_size: int = CHUNK,
                        safe_gate: bool = False, lower_bound: float | None = None,
                        use_graph: bool = False) -> tuple[torch.Tensor, ...]:
    """The stage's specification with chunk_kda_bwd_intra's arguments and outputs (dq, dk, db, dg): the module
    docstring's sums with every 2^(g_i - g_j) formed directly, in fp32 (fp64 for fp64 inputs). safe_gate and
    lower_bound (how fla's kernel keeps its factored exponentials finite) do not change the result. Tokens
    outside every listed chunk are zero here (the kernel leaves them unwritten)."""
    validate(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, chunk_size)
    B, T = k.shape[:2]
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    f = torch.promote_types(torch.float32, q.dtype)
    row_R, batch_R, tok_RC, valid_RC = chunk_rows(B, T, cu_seqlens, chunk_indices, q.device)
    idx = torch.arange(CHUNK, device=q.device)
    outs = [torch.zeros(x.shape, dtype=f, device=x.device) for x in (dq, dk, db, dg)]
    for s in range(0, len(row_R), SLAB_ROWS):
        b_R, tok, valid = batch_R[s:s + SLAB_ROWS], tok_RC[s:s + SLAB_ROWS], valid_RC[s:s + SLAB_ROWS]
        rows = functools.partial(_rows, batch_R=b_R, tok_RC=tok, valid_RC=valid, dtype=f)
        q_, k_, g_, beta_ = rows(q), rows(k), rows(g), rows(beta.unsqueeze(-1))
        pair = (valid[:, :, None] & valid[:, None, :])[:, None]  # [R, 1, i, j]
        Dq = torch.where(pair & (idx[:, None] >= idx[None, :]), rows(dAqk), 0.0)
        Dk = torch.where(pair & (idx[:, None] > idx[None, :]), rows(dAkk), 0.0)
        diff = g_[:, :, :, None, :] - g_[:, :, None, :, :]  # [R, H, i, j, K]
        E = torch.exp2(torch.where(pair[..., None] & (idx[:, None] >= idx[None, :])[..., None], diff, -math.inf))
        dq_add = torch.einsum("rhij,rhjk,rhijk->rhik", Dq, k_, E)
        r = torch.einsum("rhij,rhjk,rhijk->rhik", Dk, k_, E)
        db_add = (r * k_).sum(-1, keepdim=True)
        r = r * beta_
        t = torch.einsum("rhij,rhik,rhijk->rhjk", Dq, q_, E) + torch.einsum("rhij,rhik,rhijk->rhjk", Dk,
                                                                               k_ * beta_, E)
        adds = (dq_add, r + t, db_add, q_ * dq_add + (r - t) * k_)
        for out, base, add in zip(outs, (dq, dk, db.unsqueeze(-1), dg), adds, strict=True):
            full = (rows(base) + add).transpose(1, 2)[valid]  # [tokens, H, X]
            view = out if out.dim() == 4 else out.unsqueeze(-1)
            view[b_R[:, None].expand_as(tok)[valid], tok[valid]] = full
    return tuple(outs)


def _rows(x: torch.Tensor, batch_R: torch.Tensor, tok_RC: torch.Tensor, valid_RC: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, X] -> [R, H, C, X] of the listed chunks, zero outside their sequences."""
    return torch.where(valid_RC[:, :, None, None], x[batch_R[:, None], tok_RC].to(dtype), 0.0).transpose(1, 2)


def validate(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, dAqk: torch.Tensor,
             dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, db: torch.Tensor, dg: torch.Tensor,
             cu_seqlens: torch.Tensor | None, chunk_size: int, dqk_in_q_dtype: bool = False) -> None:
    """The stage's inputs checked (a ValueError names the fault); dqk_in_q_dtype: dq and dk may also come in q's
    dtype (moontrain.model.kda.intra_norm_kernel reads them so from moontrain's dqkg stage)."""
    if k.dim() != 4:
        raise ValueError(f"kda_intra: k must be [B, T, H, K], got {tuple(k.shape)}")
    B, T, H, K = k.shape
    if g.dim() != 4 or g.shape[2] != H:
        raise ValueError(f"kda_intra: g has shape {tuple(g.shape)} and k {tuple(k.shape)}; grouped value heads "
                         "(GVA) are not supported, use fla's chunk_kda_bwd_intra for HV != H")
    if chunk_size != CHUNK:
        raise ValueError(f"kda_intra: chunk_size={chunk_size}; the kernel takes chunk_size={CHUNK} (fla's default)")
    if K < 32 or K > 256 or K & (K - 1):
        raise ValueError(f"kda_intra: K={K}; the head dim must be a power of two in [32, 256] (the smallest tile "
                         "is 32 wide)")
    shapes = dict(q=q, g=g, dq=dq, dk=dk, dg=dg)
    for name, x in shapes.items():
        if x.shape != k.shape:
            raise ValueError(f"kda_intra: {name} has shape {tuple(x.shape)}, expected k's {tuple(k.shape)}")
    for name, x, want in (("beta", beta, (B, T, H)), ("db", db, (B, T, H)), ("dAqk", dAqk, (B, T, H, CHUNK)),
                          ("dAkk", dAkk, (B, T, H, CHUNK))):
        if x.shape != want:
            raise ValueError(f"kda_intra: {name} has shape {tuple(x.shape)}, expected {want}")
    for name, x in (("dq", dq), ("dk", dk), ("db", db), ("dg", dg)):
        in_q_dtype = dqk_in_q_dtype and name in ("dq", "dk")
        if x.dtype not in (torch.float32, torch.float64, *((q.dtype,) if in_q_dtype else ())):
            also = f" or q's dtype ({q.dtype})" if in_q_dtype else ""
            raise ValueError(f"kda_intra: {name} is {x.dtype}; the stage takes the dqkg stage's fp32 gradients{also} "
                             "(fla's chunk_kda_bwd_intra takes other dtypes)")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"kda_intra: packed documents (cu_seqlens) need batch 1, got B={B}; flatten the batch "
                         "to [1, B*T, ...] first")


def random_stage_inputs(B: int, T: int, H: int, K: int, dtype: torch.dtype, device: str, seed: int,
                        cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                        gate: float = 5.0, at_bound: bool = False) -> dict:
    """Random inputs of the stage at fla's scales, as keyword arguments: q, k unit rows (dtype); beta U(0, 1);
    g (fp32) the chunk-local cumsum of per-token log2 gates in [-gate log2(e), 0] (most near 0: -gate u^3, or
    all at the bound with at_bound: the widest exponent range a safe gate allows); dAqk, dAkk N(0, 1) fp32 with
    NaN where the stage must not read (above the diagonals, past a chunk's end); dq, dk, dg N(0, 1), db N(0, 1),
    fp32. safe_gate=True and lower_bound=-gate, as fla's KDA passes them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    _, batch_R, tok_RC, valid_RC = chunk_rows(B, T, cu_seqlens, chunk_indices, torch.device(device))
    b_RC = batch_R[:, None].expand_as(tok_RC)
    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    beta = torch.rand(B, T, H, generator=gen, device=device)
    u = torch.ones(B, T, H, K, device=device) if at_bound else torch.rand(B, T, H, K, generator=gen, device=device)
    raw = -u ** 3 * gate * math.log2(math.e)
    g = torch.zeros(B, T, H, K, device=device)
    g[b_RC[valid_RC], tok_RC[valid_RC]] = (raw[batch_R[:, None], tok_RC] * valid_RC[..., None, None]).cumsum(1)[valid_RC]
    idx = torch.arange(CHUNK, device=device)
    dAqk, dAkk = rnd(B, T, H, CHUNK), rnd(B, T, H, CHUNK)
    nan = torch.full_like(dAqk, math.nan)
    # the column c of row t is read where it lies in t's chunk at or below t (strictly below for dAkk)
    row_in_chunk = torch.full((B, T), CHUNK, dtype=torch.long, device=device)
    chunk_len = torch.zeros((B, T), dtype=torch.long, device=device)
    row_in_chunk[b_RC[valid_RC], tok_RC[valid_RC]] = idx.expand_as(tok_RC)[valid_RC]
    chunk_len[b_RC[valid_RC], tok_RC[valid_RC]] = valid_RC.sum(1, keepdim=True).expand_as(tok_RC)[valid_RC]
    col = idx.view(1, 1, 1, -1)
    pos, n = row_in_chunk[:, :, None, None], chunk_len[:, :, None, None]
    dAqk = torch.where((col <= pos) & (col < n), dAqk, nan)
    dAkk = torch.where((col < pos) & (col < n), dAkk, nan)
    grads = dict(dq=rnd(B, T, H, K), dk=rnd(B, T, H, K), db=rnd(B, T, H), dg=rnd(B, T, H, K))
    return dict(q=q.to(dtype), k=k.to(dtype), g=g, beta=beta.to(dtype if dtype == torch.float64 else torch.float32),
                dAqk=dAqk, dAkk=dAkk, **grads, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, safe_gate=True,
                lower_bound=-gate)
