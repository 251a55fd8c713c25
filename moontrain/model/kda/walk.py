"""The specification of moontrain.model.kda.walk_kernel: KDA's forward state walk and output as one stage (fla-core's
chunk_gated_delta_rule_fwd_h, then chunk_gla_fwd_o_gk, composed).

Legend: B batch, T tokens, H heads, K key head dim, V value head dim, C chunk length (64), R chunks listed
(h is indexed by them). Per sequence and head, chunk by chunk from the first (rows t of the chunk; g the
chunk-local cumulative log2 gate, gn its value at the chunk's last row; kg = k 2^(gn - g), qg = q 2^g and w,
u the WY factors, as fla's recompute_w_u_fwd makes them; Aqk the chunk's [C, C] intra-chunk scores, read on
and below the diagonal):
    h_c    = the state at the chunk's start (zero at a sequence's first chunk)       [K, V], stored
    v_new  = u - w h_c                                                                 stored
    o      = scale qg h_c + tril(Aqk) v_new
    h_next = diag(2^gn) h_c + kg^T v_new
The kernel keeps the state in fp32 and rounds h_c and v_new to the inputs' dtype where they enter a product
and where they are stored, as fla's two kernels do (h is stored in the inputs' dtype and read back by the
output's); this reference computes in the inputs' precision, at least fp32, without those roundings.

Contract: H == HV, the state stored [K, V] (fla's state_v_first=False), C = 64, K and V powers of two in
[16, 256]; packed documents as fla: B = 1, cu_seqlens, chunk_offsets (each sequence's first row in h); h has
the chunk list's rows (fla's use_graph padding rows included, left unwritten), tokens and rows outside every
sequence left unwritten.
"""

from __future__ import annotations

import math

import torch

CHUNK = 64
STAGE_OUTPUTS = ("h", "v_new", "o")


def validate(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor, qg: torch.Tensor,
             Aqk: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk_offsets: torch.Tensor | None) -> None:
    if kg.dim() != 4:
        raise ValueError(f"kda_forward_walk: kg must be [B, T, H, K], got {tuple(kg.shape)}")
    B, T, H, K = kg.shape
    V = u.shape[-1]
    for name, x, want in (("w", w, (B, T, H, K)), ("g", g, (B, T, H, K)), ("qg", qg, (B, T, H, K)),
                          ("u", u, (B, T, H, V)), ("Aqk", Aqk, (B, T, H, CHUNK))):
        if tuple(x.shape) != want:
            raise ValueError(f"kda_forward_walk: {name} has shape {tuple(x.shape)}, expected {want} (H == HV, "
                             f"chunks of {CHUNK})")
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n > 256 or n & (n - 1):
            raise ValueError(f"kda_forward_walk: {name}={n}; the head dims must be powers of two in [16, 256]")
    if cu_seqlens is not None and (B != 1 or chunk_offsets is None):
        raise ValueError(f"kda_forward_walk: packed documents (cu_seqlens) need batch 1 (got B={B}) and "
                         "chunk_offsets (each sequence's first row in h: fla's prepare_chunk_offsets)")


def _chunks(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_offsets: torch.Tensor | None):
    """(batch row, row in h, first token, end token, the sequence's first chunk) of every chunk, in walk order."""
    if cu_seqlens is None:  # (batch row, first token, end token, its first chunk's row in h) of each sequence
        seqs = [(b, 0, T, 0) for b in range(B)]
    else:
        cu, offs = cu_seqlens.tolist(), chunk_offsets.tolist()
        seqs = [(0, cu[n], cu[n + 1], offs[n]) for n in range(len(cu) - 1)]
    for b, t0, t1, r0 in seqs:
        for c, s in enumerate(range(t0, t1, CHUNK)):
            yield b, r0 + c, s, min(s + CHUNK, t1), c == 0


def kda_forward_walk_reference(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                               qg: torch.Tensor, Aqk: torch.Tensor, scale: float, *, rows: int | None = None,
                               cu_seqlens: torch.Tensor | None = None,
                               chunk_offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(h [B, R, H, K, V], v_new [B, T, H, V], o [B, T, H, V]) in the inputs' precision, at least fp32, unwritten
    entries zero. rows: R (default: the chunks the sequences take; with fla's use_graph padding, the chunk
    list's length)."""
    validate(kg, w, u, g, qg, Aqk, cu_seqlens, chunk_offsets)
    B, T, H, K = kg.shape
    V = u.shape[-1]
    p = torch.promote_types(kg.dtype, torch.float32)
    chunks = list(_chunks(B, T, cu_seqlens, chunk_offsets))
    R = rows if rows is not None else max(r for _, r, *_ in chunks) + 1
    h = torch.zeros(B, R, H, K, V, dtype=p, device=kg.device)
    v_new = torch.zeros(B, T, H, V, dtype=p, device=kg.device)
    o = torch.zeros(B, T, H, V, dtype=p, device=kg.device)
    state = None
    for b, r, s, e, first in chunks:
        if first:
            state = torch.zeros(H, K, V, dtype=p, device=kg.device)
        h[b, r] = state
        vn = u[b, s:e].to(p).transpose(0, 1) - w[b, s:e].to(p).transpose(0, 1) @ state  # [H, L, V]
        v_new[b, s:e] = vn.transpose(0, 1)
        A = torch.tril(Aqk[b, s:e, :, : e - s].to(p).transpose(0, 1))  # [H, L, L]: NaN above is never read
        o[b, s:e] = (scale * (qg[b, s:e].to(p).transpose(0, 1) @ state) + A @ vn).transpose(0, 1)
        decay = torch.exp2(g[b, e - 1].to(p))  # [H, K]
        state = decay[..., None] * state + kg[b, s:e].to(p).permute(1, 2, 0) @ vn
    return h, v_new, o


def random_walk_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: str, seed: int,
                       cu_seqlens: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None,
                       gate: float = 5.0) -> dict:
    """Random inputs at fla's scales, chunk by chunk of the sequences: g the chunk-local cumsum of log2 gates in
    [-gate log2(e), 0] (most near 0), kg and qg from unit rows of k and q and g as fla makes them, w N(0, 1/K),
    u N(0, 1), Aqk N(0, 1) with NaN above each chunk's diagonal (never read)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    raw = -torch.rand(B, T, H, K, generator=gen, device=device) ** 3 * gate * math.log2(math.e)
    Aqk = rnd(B, T, H, CHUNK)
    g, kg, qg = torch.zeros_like(raw), torch.zeros_like(k), torch.zeros_like(q)
    for b, _, s, e, _ in _chunks(B, T, cu_seqlens, chunk_offsets):
        g[b, s:e] = raw[b, s:e].cumsum(0)
        kg[b, s:e] = k[b, s:e] * torch.exp2(g[b, e - 1] - g[b, s:e])
        qg[b, s:e] = q[b, s:e] * torch.exp2(g[b, s:e])
        above = torch.arange(CHUNK, device=device) > torch.arange(e - s, device=device)[:, None]
        Aqk[b, s:e] = Aqk[b, s:e].masked_fill(above[:, None, :], math.nan)
    return dict(kg=kg.to(dtype), w=(rnd(B, T, H, K) / math.sqrt(K)).to(dtype), u=rnd(B, T, H, V).to(dtype), g=g,
                qg=qg.to(dtype), Aqk=Aqk.to(dtype), scale=K ** -0.5, cu_seqlens=cu_seqlens,
                chunk_offsets=chunk_offsets)
