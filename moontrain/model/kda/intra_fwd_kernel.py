"""KDA's forward intra-chunk stage as one Triton kernel; moontrain.model.kda.intra_fwd is the specification it
matches (the formulas, the roundings and the contract). Not on the model's route: on an H100 it takes twice the
time of fla's three launches (docs/performance.md), and it stays as the stage's tested second
implementation, timed by benchmarks/bench_kda_intra_fwd.py.

Why one kernel. fla's chunk_kda_fwd_intra runs three launches over the same chunks: the diagonal 16 x 16 score
blocks (chunk_kda_fwd_kernel_intra_sub_chunk), the off-diagonal blocks with the triangular solve
(chunk_kda_fwd_kernel_inter_solve_fused), then recompute_w_u_fwd, after a zero fill of Akk. Each reads q, k and
the fp32 g from memory again (3 x 268 MB at 4 x 4096 x 16 heads of 128), and the first two hand their blocks on
through memory. Here one program per (chunk, head) does all three, its second pass over q, k and g mostly from L2.
Why it is slower: its [64, 64] fp32 tiles take 247 registers at 8 warps, one program an SM, so its serial steps
(the substitution's above all) are not hidden behind other programs as fla's one-warp programs hide theirs.

Kernel. Scores: per K-block and column block t (16 keys), a [C, BK] x [BK, C] tf32 product whose key operand is
zero outside block t, the exponentials factored at an anchor a_t = g at the block's first row minus a fixed shift
(fla's): queries take 2^(g_i - a_t) (rows i >= 16 t only), keys 2^(a_t - g_j). Anchoring at the key's block keeps
every factor finite for gates at the safe gate's bound: a query factor is at most 2^shift, and one that underflows
stands for a product below 2^-40 (fla anchors off-diagonal blocks at the query's block, where a key 48 rows back
can overflow). Solve: the diagonal blocks of I + L are inverted together by forward substitution in fp32 (14
steps, each a row of every block; kept transposed so the reductions stay within a warp), then Akk = D - M D +
M^2 D - M^3 D with D that block inverse and M = D N (N the blocks below the diagonal), as three tf32 products
X <- D - M X. w, u, qg and kg follow as recompute_w_u_fwd forms them, from the rounded Akk.
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

BC = 16  # the sub-chunk: the diagonal blocks inverted by substitution, the column blocks of the scores
# the anchor's shift below the block's first gate (log2 units), fla's for chunk_kda: (BC - 1) / 2 x 2 nats
SHIFT = 0.5 * (BC - 1) * 2.0 / math.log(2.0)
# the launch's tile at K = V = 128 on an H100 (benchmarks/bench_kda_intra_fwd.py, docs/performance.md): K-blocks of
# 64 at 8 warps (247 registers, one program an SM); at 4 warps triton 3.6 miscompiles the w product (wrong w, then
# an illegal shared-memory address), so 4 warps are refused
BK = 64
BV = 64
WARPS = 8
STAGES = 1


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _intra_fwd_kernel(q, k, v, g, beta, Aqk, Akk, w, u, qg, kg, cu_seqlens, chunk_indices, scale, T,
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
        beta += row * H + i_h
        o_t = tl.arange(0, BT)
        o_j = tl.arange(0, BT)
        m_t = o_t < n

        # the scores: per K-block, column block by column block (keys zero outside block t)
        b_Sq = tl.zeros([BT, BT], dtype=tl.float32)
        b_Sk = tl.zeros([BT, BT], dtype=tl.float32)
        blk = o_t // BC
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            p_t = o_t[:, None] * (H * K) + o_k[None, :]
            b_q = tl.load(q + p_t, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_k = tl.load(k + p_t, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_g = tl.load(g + p_t, mask=m_t[:, None], other=0.0)
            # each key row at its own block's anchor
            b_a = tl.load(g + (blk * BC)[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None], other=0.0) - SH
            b_kf = tl.where(m_t[:, None], b_k * tl.exp2(b_a - b_g), 0.0)
            for t in tl.static_range(BT // BC):
                b_at = tl.load(g + t * BC * (H * K) + o_k, mask=(o_k >= 0) & (t * BC < n), other=0.0) - SH
                b_e = tl.where(((o_t >= t * BC) & m_t)[:, None], tl.exp2(tl.minimum(b_g - b_at[None, :], SH)), 0.0)
                b_kt = tl.trans(tl.where((blk == t)[:, None], b_kf, 0.0))
                b_Sq = tl.dot(b_q * b_e, b_kt, b_Sq, input_precision="tf32")
                b_Sk = tl.dot(b_k * b_e, b_kt, b_Sk, input_precision="tf32")
        p_A = o_t[:, None] * (H * BT) + o_j[None, :]
        b_A = tl.where(o_t[:, None] >= o_j[None, :], b_Sq * scale, 0.0)
        tl.store(Aqk + p_A, b_A.to(Aqk.dtype.element_ty), mask=m_t[:, None])
        b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0)
        b_L = tl.where(o_t[:, None] > o_j[None, :], b_Sk * b_b.to(tl.float32)[:, None], 0.0)

        # the diagonal blocks' inverse D = I + Y^T, Y built column by column (a row of each block a step)
        same = (o_t[:, None] // BC) == (o_j[None, :] // BC)
        b_Y = -tl.trans(tl.where(same, b_L, 0.0))
        for r in range(2, BC):
            sel = (o_j % BC) == r
            b_a = tl.sum(tl.where(sel[None, :], b_Y, 0.0), axis=1)
            b_a += tl.sum(b_Y * b_a[None, :], axis=1)
            b_Y = tl.where(sel[None, :] & same, b_a[:, None], b_Y)
        b_D = tl.trans(b_Y) + tl.where(o_t[:, None] == o_j[None, :], 1.0, 0.0)
        b_M = tl.dot(b_D, tl.where(same, 0.0, b_L), input_precision="tf32")
        b_X = b_D
        for _ in tl.static_range(BT // BC - 1):
            b_X = b_D - tl.dot(b_M, b_X, input_precision="tf32")
        b_X = b_X.to(Akk.dtype.element_ty)
        tl.store(Akk + p_A, b_X, mask=m_t[:, None])

        # w, qg, kg and u from the rounded Akk
        b_gn = g + (n - 1) * (H * K)
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            p_t = o_t[:, None] * (H * K) + o_k[None, :]
            b_k = tl.load(k + p_t, mask=m_t[:, None], other=0.0)
            b_g = tl.load(g + p_t, mask=m_t[:, None], other=0.0)
            b_eg = tl.exp2(b_g)
            b_kb = (b_k * b_b[:, None]) * b_eg
            tl.store(w + p_t, tl.dot(b_X, b_kb.to(b_k.dtype)).to(w.dtype.element_ty), mask=m_t[:, None])
            b_qg = tl.load(q + p_t, mask=m_t[:, None], other=0.0) * b_eg
            tl.store(qg + p_t, b_qg.to(qg.dtype.element_ty), mask=m_t[:, None])
            b_kg = b_k * tl.where(m_t[:, None], tl.exp2(tl.load(b_gn + o_k)[None, :] - b_g), 0.0)
            tl.store(kg + p_t, b_kg.to(kg.dtype.element_ty), mask=m_t[:, None])
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            p_v = o_t[:, None] * (H * V) + o_v[None, :]
            b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.0)
            b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
            tl.store(u + p_v, tl.dot(b_X, b_vb).to(u.dtype.element_ty), mask=m_t[:, None])


def kda_intra_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, *, cu_seqlens: torch.Tensor | None = None,
                      chunk_indices: torch.Tensor | None = None, bk: int = BK, bv: int = BV, warps: int = WARPS,
                      stages: int = STAGES) -> tuple[torch.Tensor, ...]:
    """(w, u, qg, kg, Aqk, Akk) as fla's chunk_kda_fwd_intra(safe_gate=True, disable_recompute=True) returns them
    (Aqk and Akk in k's dtype, zero above their diagonals), in one launch. q, k, v one dtype, beta fp32 (the
    model's) or theirs, g fp32, all contiguous; with documents, chunk_indices as fla lists them (padding rows of
    sequence -1 skipped). bk, bv, warps, stages: the launch's (benchmarks/bench_kda_intra_fwd.py sweeps them)."""
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
    if warps == 4:
        raise ValueError("kda_intra_forward: warps=4 is refused: triton 3.6 miscompiles the kernel's w product at 4 "
                         "warps (wrong w, then an illegal shared-memory address on an H100); use 8 (or 2)")
    if K % bk or V % bv or bk < 16 or bv < 16:
        raise ValueError(f"kda_intra_forward: bk={bk} must divide K={K} and bv={bv} V={V}, both >= 16")
    if cu_seqlens is not None and chunk_indices is None:
        raise ValueError("kda_intra_forward: packed documents need chunk_indices (fla's prepare_chunk_indices)")
    rows = triton.cdiv(T, CHUNK) if cu_seqlens is None else chunk_indices.shape[0]
    w, qg, kg = torch.empty_like(k), torch.empty_like(k), torch.empty_like(k)
    u = torch.empty_like(v)
    Aqk, Akk = k.new_empty(B, T, H, CHUNK), k.new_empty(B, T, H, CHUNK)
    _intra_fwd_kernel[(rows, B * H)](q, k, v, g, beta, Aqk, Akk, w, u, qg, kg, cu_seqlens, chunk_indices, scale, T,
                                     H=H, K=K, V=V, BT=CHUNK, BC=BC, BK=bk, BV=bv, SH=SHIFT,
                                     IS_VARLEN=cu_seqlens is not None, num_warps=warps, num_stages=stages)
    return w, u, qg, kg, Aqk, Akk
