"""KDA's forward intra-chunk stage in two launches; moontrain.model.kda.intra_fwd is the specification it matches
(the formulas, the roundings and the contract). Not on the model's route: on an H100 it takes 1.2 times the time
of fla's stage (705 against 582 us at 4 x 4096 x 16), and it stays as the stage's tested second implementation,
timed by benchmarks/bench_kda_intra_fwd.py (docs/performance.md: where its time goes).

Why. fla's chunk_kda_fwd_intra runs three launches and a fill over the same chunks: the diagonal 16 x 16 score
blocks with their inverses (chunk_kda_fwd_kernel_intra_sub_chunk), a zero fill of Akk, the off-diagonal blocks
with the triangular solve (chunk_kda_fwd_kernel_inter_solve_fused), then recompute_w_u_fwd. The last two each
read q, k and the fp32 g from memory again, and the solve hands Akk to recompute_w_u through memory. Here the
first launch is fla's own sub-chunk kernel (its diagonal blocks, bit for bit), and the second does the rest in
one program per (chunk, head): the off-diagonal scores, the block merge into Akk, and w, u, qg and kg from the
rounded Akk held in registers, its second read of q, k and g mostly from L2. Why that does not pay: the w, qg
and kg pass is bound by memory traffic, and the scores' registers (255, spilling) leave it one warp a program and
few programs an SM: it moves its ~470 MB at ~1.7 TB/s, fla's recompute_w_u (u too) ~600 MB at ~2.5.

Kernel (_solve_wu_kernel), on fla's 16 x 16 blocks (BC): the chunk's four row blocks s and the six pairs t < s.
- Scores: per K-block, for each pair a [BC, BK] x [BK, BC] tf32 product for q-k and one for k-k, the
  exponentials factored at an anchor a_t = g at block t's first row minus a fixed shift (fla's): queries take
  2^(g_i - a_t), keys 2^(a_t - g_j). Anchoring at the key's block keeps every factor finite for gates at the
  safe gate's bound: a query factor is at most 2^shift, one that underflows stands for a product below 2^-40
  (fla's inter_solve anchors at the query's block, where a key 48 rows back can overflow).
- Merge: with D_s the diagonal blocks' fp32 inverses (the first launch's) and L the strictly lower blocks of
  beta K K^T, block forward substitution X_st = -D_s sum_{t <= r < s} L_sr X_rt (X_tt = D_t), tf32 products.
- w, u: Akk's blocks rounded to k's dtype times beta k 2^g and beta v rounded the same way (fla's
  recompute_w_u_fwd); qg = q 2^g, kg = k 2^(g_last - g).
Registers (ptxas, triton 3.6, sm_90, BK 32): 255 at every warp count, spilling 288 bytes at 1 warp, 32 at 4.
"""

from __future__ import annotations

import math

import torch

from moontrain.model.kda.intra_fwd import CHUNK, validate

try:
    import triton
    import triton.language as tl
except ImportError:  # the specification runs without triton; the launcher needs it
    triton = None

BC = 16  # fla's sub-chunk: the diagonal blocks its first kernel inverts, the merge's block size
# the anchor's shift below the block's first gate (log2 units), fla's for chunk_kda: (BC - 1) / 2 x 2 nats
SHIFT = 0.5 * (BC - 1) * 2.0 / math.log(2.0)
# fla's first kernel's gate shift per row of a block (log2 units): chunk_kda passes no lower bound, so 2 nats
GATE_SHIFT = 2.0 / math.log(2.0)
# the second launch's tile at K = V = 128 on an H100 (benchmarks/bench_kda_intra_fwd.py, docs/performance.md):
# one warp a program (705 us; 2 warps 839, 4 warps 1,056), 64-wide K-blocks slower (860-1,017)
BK = 32
BV = 64
WARPS = 1
STAGES = 1


if triton is not None:
    @triton.jit
    def _pair(q_s, k_s, g_s, m_s, k_t, g_t, a_t, SH: tl.constexpr):
        """block (s, t < s) of the q-k and k-k scores over one K-block, the keys anchored at a_t."""
        e = tl.where(m_s[:, None], tl.exp2(tl.minimum(g_s - a_t[None, :], SH)), 0.0)
        kt = tl.trans(k_t * tl.exp2(a_t[None, :] - g_t))
        return tl.dot(q_s * e, kt, input_precision="tf32"), tl.dot(k_s * e, kt, input_precision="tf32")

    @triton.jit
    def _block(p, o_c, o_n, s: tl.constexpr, BC: tl.constexpr, ld, n):
        """rows of block s (zeros past the chunk's n rows), in fp32, and their mask."""
        m = (s * BC + o_c) < n
        x = tl.load(p + (s * BC + o_c)[:, None] * ld + o_n[None, :], mask=m[:, None], other=0.0)
        return x.to(tl.float32), m

    @triton.jit
    def _mm(a, b):
        return tl.dot(a, b, input_precision="tf32")

    @triton.jit
    def _store(p, x, o_c, o_n, s: tl.constexpr, BC: tl.constexpr, ld, n):
        m = (s * BC + o_c) < n
        tl.store(p + (s * BC + o_c)[:, None] * ld + o_n[None, :], x.to(p.dtype.element_ty), mask=m[:, None])

    @triton.jit
    def _zero_above(p, z, o_c, BC: tl.constexpr, ld, n):
        """the six [BC, BC] blocks above a chunk matrix's diagonal blocks, zeroed."""
        for s in tl.static_range(3):
            for t in tl.static_range(s + 1, 4):
                _store(p + t * BC, z, o_c, o_c, s, BC, ld, n)

    @triton.jit
    def _gated_keys(k, g, q, qg, kg, g_last, b, o_c, o_k, s: tl.constexpr, BC: tl.constexpr, HK: tl.constexpr, n):
        """block s's rows of qg and kg, stored; returns beta k 2^g rounded to k's dtype (w's operand)."""
        m = (s * BC + o_c) < n
        p = (s * BC + o_c)[:, None] * HK + o_k[None, :]
        kk = tl.load(k + p, mask=m[:, None], other=0.0)
        gg = tl.load(g + p, mask=m[:, None], other=0.0)
        eg = tl.exp2(gg)
        tl.store(qg + p, (tl.load(q + p, mask=m[:, None], other=0.0) * eg).to(qg.dtype.element_ty), mask=m[:, None])
        tl.store(kg + p, (kk * tl.where(m[:, None], tl.exp2(g_last[None, :] - gg), 0.0)).to(kg.dtype.element_ty),
                 mask=m[:, None])
        return ((kk * b[:, None]) * eg).to(kk.dtype)

    @triton.jit
    def _beta_values(v, b, o_c, o_v, s: tl.constexpr, BC: tl.constexpr, HV: tl.constexpr, n):
        m = (s * BC + o_c) < n
        vv = tl.load(v + (s * BC + o_c)[:, None] * HV + o_v[None, :], mask=m[:, None], other=0.0)
        return (vv * b[:, None]).to(vv.dtype)

    @triton.jit(do_not_specialize=["T"])
    def _solve_wu_kernel(q, k, v, g, beta, Aqk, Akkd, Akk, w, u, qg, kg, cu_seqlens, chunk_indices, scale, T,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, SH: tl.constexpr, IS_VARLEN: tl.constexpr):
        i_t = tl.program_id(0).to(tl.int64)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        if IS_VARLEN:
            i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
            if i_n < 0:  # fla's use_graph padding row
                return
            i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            n_seq = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        else:
            bos = i_b * T
            n_seq = T
        n = tl.minimum(n_seq - i_t * BT, BT).to(tl.int32)  # the chunk's rows
        row = bos + i_t * BT  # its first token; pointers at that token, this head
        q += (row * H + i_h) * K
        k += (row * H + i_h) * K
        g += (row * H + i_h) * K
        w += (row * H + i_h) * K
        qg += (row * H + i_h) * K
        kg += (row * H + i_h) * K
        v += (row * H + i_h) * V
        u += (row * H + i_h) * V
        Aqk += (row * H + i_h) * BT
        Akk += (row * H + i_h) * BT
        Akkd += (row * H + i_h) * BC
        beta += row * H + i_h
        o_c = tl.arange(0, BC)
        HK: tl.constexpr = H * K
        LD: tl.constexpr = H * BT
        z = tl.zeros([BC, BC], dtype=tl.float32)
        # the off-diagonal blocks (s, t): q-k scores qst, k-k scores kst
        q10, k10, q20, k20, q21, k21, q30, k30, q31, k31, q32, k32 = z, z, z, z, z, z, z, z, z, z, z, z
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            k0, _ = _block(k, o_c, o_k, 0, BC, HK, n)
            g0, _ = _block(g, o_c, o_k, 0, BC, HK, n)
            q1, m1 = _block(q, o_c, o_k, 1, BC, HK, n)
            k1, _ = _block(k, o_c, o_k, 1, BC, HK, n)
            g1, _ = _block(g, o_c, o_k, 1, BC, HK, n)
            q2, m2 = _block(q, o_c, o_k, 2, BC, HK, n)
            k2, _ = _block(k, o_c, o_k, 2, BC, HK, n)
            g2, _ = _block(g, o_c, o_k, 2, BC, HK, n)
            q3, m3 = _block(q, o_c, o_k, 3, BC, HK, n)
            k3, _ = _block(k, o_c, o_k, 3, BC, HK, n)
            g3, _ = _block(g, o_c, o_k, 3, BC, HK, n)
            a0 = tl.load(g + o_k) - SH
            a1 = tl.load(g + BC * HK + o_k, mask=(o_k >= 0) & (BC < n), other=0.0) - SH
            a2 = tl.load(g + 2 * BC * HK + o_k, mask=(o_k >= 0) & (2 * BC < n), other=0.0) - SH
            # each pair's sums added here: accumulators passed into _pair compile to more spilled registers
            dq, dk = _pair(q1, k1, g1, m1, k0, g0, a0, SH)
            q10 += dq
            k10 += dk
            dq, dk = _pair(q2, k2, g2, m2, k0, g0, a0, SH)
            q20 += dq
            k20 += dk
            dq, dk = _pair(q2, k2, g2, m2, k1, g1, a1, SH)
            q21 += dq
            k21 += dk
            dq, dk = _pair(q3, k3, g3, m3, k0, g0, a0, SH)
            q30 += dq
            k30 += dk
            dq, dk = _pair(q3, k3, g3, m3, k1, g1, a1, SH)
            q31 += dq
            k31 += dk
            dq, dk = _pair(q3, k3, g3, m3, k2, g2, a2, SH)
            q32 += dq
            k32 += dk
        # Aqk's blocks below the diagonal (the first launch wrote the diagonal ones), zeros above it
        _store(Aqk, q10 * scale, o_c, o_c, 1, BC, LD, n)
        _store(Aqk, q20 * scale, o_c, o_c, 2, BC, LD, n)
        _store(Aqk + BC, q21 * scale, o_c, o_c, 2, BC, LD, n)
        _store(Aqk, q30 * scale, o_c, o_c, 3, BC, LD, n)
        _store(Aqk + BC, q31 * scale, o_c, o_c, 3, BC, LD, n)
        _store(Aqk + 2 * BC, q32 * scale, o_c, o_c, 3, BC, LD, n)
        _zero_above(Aqk, z, o_c, BC, LD, n)
        b1 = tl.load(beta + (BC + o_c) * H, mask=(BC + o_c) < n, other=0.0).to(tl.float32)
        b2 = tl.load(beta + (2 * BC + o_c) * H, mask=(2 * BC + o_c) < n, other=0.0).to(tl.float32)
        b3 = tl.load(beta + (3 * BC + o_c) * H, mask=(3 * BC + o_c) < n, other=0.0).to(tl.float32)
        L10, L20, L21 = k10 * b1[:, None], k20 * b2[:, None], k21 * b2[:, None]
        L30, L31, L32 = k30 * b3[:, None], k31 * b3[:, None], k32 * b3[:, None]
        # block forward substitution from the diagonal blocks' inverses
        D0, _ = _block(Akkd, o_c, o_c, 0, BC, H * BC, n)
        D1, _ = _block(Akkd, o_c, o_c, 1, BC, H * BC, n)
        D2, _ = _block(Akkd, o_c, o_c, 2, BC, H * BC, n)
        D3, _ = _block(Akkd, o_c, o_c, 3, BC, H * BC, n)
        X10 = -_mm(D1, _mm(L10, D0))
        X21 = -_mm(D2, _mm(L21, D1))
        X20 = -_mm(D2, _mm(L20, D0) + _mm(L21, X10))
        X32 = -_mm(D3, _mm(L32, D2))
        X31 = -_mm(D3, _mm(L31, D1) + _mm(L32, X21))
        X30 = -_mm(D3, _mm(L30, D0) + _mm(L31, X10) + _mm(L32, X20))
        dt = Akk.dtype.element_ty
        A00, A10, A11, A20, A21, A22 = D0.to(dt), X10.to(dt), D1.to(dt), X20.to(dt), X21.to(dt), D2.to(dt)
        A30, A31, A32, A33 = X30.to(dt), X31.to(dt), X32.to(dt), D3.to(dt)
        _store(Akk, A00, o_c, o_c, 0, BC, LD, n)
        _store(Akk, A10, o_c, o_c, 1, BC, LD, n)
        _store(Akk + BC, A11, o_c, o_c, 1, BC, LD, n)
        _store(Akk, A20, o_c, o_c, 2, BC, LD, n)
        _store(Akk + BC, A21, o_c, o_c, 2, BC, LD, n)
        _store(Akk + 2 * BC, A22, o_c, o_c, 2, BC, LD, n)
        _store(Akk, A30, o_c, o_c, 3, BC, LD, n)
        _store(Akk + BC, A31, o_c, o_c, 3, BC, LD, n)
        _store(Akk + 2 * BC, A32, o_c, o_c, 3, BC, LD, n)
        _store(Akk + 3 * BC, A33, o_c, o_c, 3, BC, LD, n)
        _zero_above(Akk, z, o_c, BC, LD, n)
        # w, qg, kg and u from the rounded Akk
        b0 = tl.load(beta + o_c * H, mask=o_c < n, other=0.0)
        b1, b2, b3 = b1.to(beta.dtype.element_ty), b2.to(beta.dtype.element_ty), b3.to(beta.dtype.element_ty)
        g_end = g + (n - 1) * HK
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            g_last = tl.load(g_end + o_k)
            x0 = _gated_keys(k, g, q, qg, kg, g_last, b0, o_c, o_k, 0, BC, HK, n)
            x1 = _gated_keys(k, g, q, qg, kg, g_last, b1, o_c, o_k, 1, BC, HK, n)
            x2 = _gated_keys(k, g, q, qg, kg, g_last, b2, o_c, o_k, 2, BC, HK, n)
            x3 = _gated_keys(k, g, q, qg, kg, g_last, b3, o_c, o_k, 3, BC, HK, n)
            _store(w, tl.dot(A00, x0), o_c, o_k, 0, BC, HK, n)
            _store(w, tl.dot(A10, x0) + tl.dot(A11, x1), o_c, o_k, 1, BC, HK, n)
            _store(w, tl.dot(A20, x0) + tl.dot(A21, x1) + tl.dot(A22, x2), o_c, o_k, 2, BC, HK, n)
            _store(w, tl.dot(A30, x0) + tl.dot(A31, x1) + tl.dot(A32, x2) + tl.dot(A33, x3), o_c, o_k, 3, BC, HK, n)
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            y0 = _beta_values(v, b0, o_c, o_v, 0, BC, H * V, n)
            y1 = _beta_values(v, b1, o_c, o_v, 1, BC, H * V, n)
            y2 = _beta_values(v, b2, o_c, o_v, 2, BC, H * V, n)
            y3 = _beta_values(v, b3, o_c, o_v, 3, BC, H * V, n)
            _store(u, tl.dot(A00, y0), o_c, o_v, 0, BC, H * V, n)
            _store(u, tl.dot(A10, y0) + tl.dot(A11, y1), o_c, o_v, 1, BC, H * V, n)
            _store(u, tl.dot(A20, y0) + tl.dot(A21, y1) + tl.dot(A22, y2), o_c, o_v, 2, BC, H * V, n)
            _store(u, tl.dot(A30, y0) + tl.dot(A31, y1) + tl.dot(A32, y2) + tl.dot(A33, y3), o_c, o_v, 3, BC,
                   H * V, n)


def kda_intra_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, *, cu_seqlens: torch.Tensor | None = None,
                      chunk_indices: torch.Tensor | None = None, bk: int = BK, bv: int = BV, warps: int = WARPS,
                      stages: int = STAGES) -> tuple[torch.Tensor, ...]:
    """(w, u, qg, kg, Aqk, Akk) as fla's chunk_kda_fwd_intra(safe_gate=True, disable_recompute=True) returns them
    (Aqk and Akk in k's dtype, zero above their diagonals), in two launches. q, k, v one dtype, beta fp32 (the
    model's) or theirs, g fp32, all contiguous; with documents, chunk_indices as fla lists them (padding rows of
    sequence -1 skipped). bk, bv, warps, stages: the second launch's (benchmarks/bench_kda_intra_fwd.py sweeps
    them); the first is fla's kernel with fla's own tile choice."""
    if triton is None:
        raise ValueError("kda_intra_forward: triton is not installed; use moontrain.model.kda.intra_fwd's reference")
    validate(q, k, v, g, beta, cu_seqlens)
    named = dict(q=q, k=k, v=v, g=g, beta=beta)
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"kda_intra_forward: {name} is not contiguous (strides {t.stride()}); call .contiguous()")
    if g.dtype != torch.float32 or len({q.dtype, k.dtype, v.dtype}) != 1 or beta.dtype not in (torch.float32,
                                                                                           q.dtype):
        raise ValueError(f"kda_intra_forward: g must be fp32, q, k, v one dtype and beta fp32 or theirs, got "
                         f"{ {n: str(t.dtype) for n, t in named.items()} }")
    B, T, H, K = k.shape
    V = v.shape[-1]
    bk, bv = min(bk, K), min(bv, V)
    if K % bk or V % bv or bk < 16 or bv < 16:
        raise ValueError(f"kda_intra_forward: bk={bk} must divide K={K} and bv={bv} V={V}, both >= 16")
    if cu_seqlens is not None and chunk_indices is None:
        raise ValueError("kda_intra_forward: packed documents need chunk_indices (fla's prepare_chunk_indices)")
    try:  # the first launch is fla's kernel
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_kernel_intra_sub_chunk
        from fla.utils import IS_GATHER_SUPPORTED
    except ImportError as e:
        raise ValueError("kda_intra_forward: its first launch is fla-core's diagonal-block kernel; install "
                         "fla-core (pip install fla-core==0.6.0; on the GPU machine: bash ../shared/device/stage.sh "
                         "fla)") from e

    rows = triton.cdiv(T, CHUNK) if cu_seqlens is None else chunk_indices.shape[0]
    Aqk = k.new_empty(B, T, H, CHUNK)
    Akkd = torch.empty(B, T, H, BC, device=k.device, dtype=torch.float32)  # the diagonal blocks' inverses
    chunk_kda_fwd_kernel_intra_sub_chunk[(rows, CHUNK // BC, B * H)](
        q=q, k=k, g=g, beta=beta, Aqk=Aqk, Akk=Akkd, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        T=T, H=H, HV=H, K=K, BT=CHUNK, BC=BC, BK=triton.next_power_of_2(K), GATE_SHIFT=GATE_SHIFT,
        USE_GATHER=IS_GATHER_SUPPORTED, USE_GRAPH=cu_seqlens is not None)
    w, qg, kg = torch.empty_like(k), torch.empty_like(k), torch.empty_like(k)
    u = torch.empty_like(v)
    Akk = k.new_empty(B, T, H, CHUNK)
    _solve_wu_kernel[(rows, B * H)](q, k, v, g, beta, Aqk, Akkd, Akk, w, u, qg, kg, cu_seqlens, chunk_indices, scale,
                                    T, H=H, K=K, V=V, BT=CHUNK, BC=BC, BK=bk, BV=bv, SH=SHIFT,
                                    IS_VARLEN=cu_seqlens is not None, num_warps=warps, num_stages=stages)
    return w, u, qg, kg, Aqk, Akk
