"""KDA's forward state walk and output as one Triton kernel; moontrain.model.kda.walk is the specification it
matches (the formulas, the roundings and the contract).

Why one kernel. fla's chunk_kda runs the walk (chunk_gated_delta_rule_fwd_h: h and v_new) and then the output
(chunk_gla_fwd_o_gk) as two launches: the second reads back the h and v_new the first just wrote, reads q and
the fp32 g to form q 2^g again, and writes an o that fla first fills with zeros. The walk's programs hold each
chunk's state and v_new in their registers, and qg (q 2^g, which fla's recompute_w_u_fwd already stores for the
backward) is the output's other operand, so the output can be formed there: ~0.37 GB less traffic a call at
4 x 4096 x 16 heads of 128, one launch and one fill less.

Kernel. One program per (V-block of BV columns, sequence, head) walks its sequence's chunks in order, the state
[K, BV] in fp32 registers. Per chunk: store the state (rounded to the inputs' dtype: fla's h), v_new = u - w h
(stored rounded), o = scale qg h + tril(Aqk) v_new (stored), then the state decays by 2^gn per key row and gains
kg^T v_new. The products take the rounded state and v_new, and their operands and their order are fla's two
kernels', so h, v_new and o are expected bitwise equal to fla's (the tests check it in Triton's interpreter).
The chunk's loads do not depend on the state, so Triton's pipeliner issues them a chunk ahead (num_stages).
Base pointers advance by whole chunks in int64; tile offsets stay int32.
"""

from __future__ import annotations

import torch

from moontrain.model.kda.walk import CHUNK, validate

try:
    import triton
    import triton.language as tl
except ImportError:  # the specification runs without triton; the launcher needs it
    triton = None

# the launch's tile at K = V = 128 on an H100 (benchmarks/bench_kda_walk.py, docs/performance.md): value blocks of 64
# (128 programs at 4 x 4096 x 16 heads, one an SM: 255 registers) with the next chunk's loads one stage ahead; 32
# (two an SM) or 1 stage was slower, 3 stages do not fit the shared memory
BV = 64
WARPS = 4
STAGES = 2


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _walk_kernel(kg, w, u, g, qg, A, h, v_new, o, cu_seqlens, chunk_offsets, scale, T, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1).to(tl.int64)
        i_n, i_h = i_nh // H, i_nh % H
        if IS_VARLEN:
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            n_tok = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
            boh = tl.load(chunk_offsets + i_n).to(tl.int64)
        else:
            bos = i_n * T
            n_tok = T
            boh = i_n * tl.cdiv(T, BT)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        m_s = o_i[:, None] >= o_i[None, :]
        p_K = o_i[:, None] * (H * K) + o_k[None, :]  # a chunk's [BT, K] rows
        p_KT = o_k[:, None] + o_i[None, :] * (H * K)  # the same, as [K, BT]
        p_V = o_i[:, None] * (H * V) + o_v[None, :]
        p_A = o_i[:, None] * (H * BT) + o_i[None, :]
        p_h = o_k[:, None] * V + o_v[None, :]
        # the chunk's first row, this head: advanced by a chunk a step
        kg += (bos * H + i_h) * K
        w += (bos * H + i_h) * K
        qg += (bos * H + i_h) * K
        g += (bos * H + i_h) * K
        u += (bos * H + i_h) * V
        v_new += (bos * H + i_h) * V
        o += (bos * H + i_h) * V
        A += (bos * H + i_h) * BT
        h += (boh * H + i_h) * (K * V)
        b_h = tl.zeros([K, BV], dtype=tl.float32)
        for c0 in range(0, n_tok, BT):
            m_t = (c0 + o_i) < n_tok
            b_hc = b_h.to(h.dtype.element_ty)
            tl.store(h + p_h, b_hc)
            b_v = tl.dot(tl.load(w + p_K, mask=m_t[:, None], other=0.0), b_hc)
            b_v = tl.load(u + p_V, mask=m_t[:, None], other=0.0) - b_v
            b_vc = b_v.to(v_new.dtype.element_ty)
            tl.store(v_new + p_V, b_vc, mask=m_t[:, None])
            b_o = tl.dot(tl.load(qg + p_K, mask=m_t[:, None], other=0.0), b_hc)
            b_o *= scale
            b_A = tl.load(A + p_A, mask=m_t[:, None], other=0.0)
            b_o = tl.dot(tl.where(m_s, b_A, 0.0).to(b_vc.dtype), b_vc, b_o)
            tl.store(o + p_V, b_o.to(o.dtype.element_ty), mask=m_t[:, None])
            b_gn = tl.load(g + (tl.minimum(c0 + BT, n_tok) - 1 - c0) * (H * K) + o_k)
            b_h *= tl.exp2(b_gn)[:, None]
            b_h = tl.dot(tl.load(kg + p_KT, mask=m_t[None, :], other=0.0), b_vc, b_h)
            kg += BT * H * K
            w += BT * H * K
            qg += BT * H * K
            g += BT * H * K
            u += BT * H * V
            v_new += BT * H * V
            o += BT * H * V
            A += BT * H * BT
            h += H * K * V


def kda_forward_walk(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor, qg: torch.Tensor,
                     Aqk: torch.Tensor, scale: float, *, cu_seqlens: torch.Tensor | None = None,
                     chunk_offsets: torch.Tensor | None = None, rows: int | None = None, bv: int = BV,
                     warps: int = WARPS, stages: int = STAGES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [B, R, H, K, V], v_new [B, T, H, V], o [B, T, H, V]) in kg's dtype: fla's chunk_gated_delta_rule_fwd_h
    (k=kg, gk=g, no initial or final state) and chunk_gla_fwd_o_gk (q, g) in one launch, qg = q 2^g as
    recompute_w_u_fwd stores it. rows: with documents, R, h's chunk rows (the chunk list's length, fla's use_graph
    padding included; default: chunk_offsets[-1], a host sync). bv, warps, stages: the launch's
    (benchmarks/bench_kda_walk.py sweeps them)."""
    if triton is None:
        raise ValueError("kda_forward_walk: triton is not installed; use moontrain.model.kda.walk's reference")
    validate(kg, w, u, g, qg, Aqk, cu_seqlens, chunk_offsets)
    named = dict(kg=kg, w=w, u=u, g=g, qg=qg, Aqk=Aqk)
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"kda_forward_walk: {name} is not contiguous (strides {t.stride()}); call .contiguous()")
    if g.dtype != torch.float32 or len({t.dtype for n, t in named.items() if n != "g"}) != 1:
        raise ValueError(f"kda_forward_walk: g must be fp32 and kg, w, u, qg, Aqk one dtype, got "
                         f"{ {n: str(t.dtype) for n, t in named.items()} }")
    B, T, H, K = kg.shape
    V = u.shape[-1]
    if V % bv or bv < 16:
        raise ValueError(f"kda_forward_walk: bv={bv} must divide V={V} and be >= 16")
    if cu_seqlens is None:
        N, R = B, triton.cdiv(T, CHUNK)
    else:
        N = cu_seqlens.numel() - 1
        R = rows if rows is not None else int(chunk_offsets[-1])
    h = kg.new_empty(B, R, H, K, V)
    v_new, o = torch.empty_like(u), torch.empty_like(u)
    _walk_kernel[(V // bv, N * H)](kg, w, u, g, qg, Aqk, h, v_new, o, cu_seqlens, chunk_offsets, scale, T, H=H, K=K,
                                   V=V, BT=CHUNK, BV=bv, IS_VARLEN=cu_seqlens is not None, num_warps=warps,
                                   num_stages=stages)
    return h, v_new, o
