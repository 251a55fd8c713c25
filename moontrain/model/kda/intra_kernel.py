"""KDA's chunked backward, the intra-chunk stage (fla-core's chunk_kda_bwd_intra) as one Triton kernel with
fla's arguments and outputs; moontrain.model.kda.intra is the specification it matches (its docstring: the
sums, the legend and the contract).

Kernel. One program per (chunk, K-block, head) holds the chunk's 64 rows of q, k, g and the three fp32
accumulators ([C, BK] each: dq's addition, r, and t) and reads each input tile once: fla's kernel runs one
program per (16-row sub-chunk, 32-wide K-block, chunk, head), 16x16x32 products, and re-reads k, g and the
[16, 16] tiles of dAqk / dAkk for every pair of sub-chunks.

The exponentials. 2^(g_i - g_j) is factored as 2^(g_i - a) 2^(a - g_j) around an anchor a, so that the sums are
matrix products; the factors must stay finite over a chunk whose gate can fall by 7.2 (log2) a token. The
chunk's 16-row blocks give two kinds of pairs:
- rows i and j in one block: a is g at the block's middle row, so |g - a| <= 8 tokens of decay and both
  factors lie in [2^-116, 2^116] while every token's log-decay is >= -10 (fla's safe gate with lower_bound >=
  -10; moontrain routes the stage here only then). One [C, C] x [C, BK] product with the block-diagonal part
  of dAqk (dAkk), all four blocks at once (the row anchors gathered per row).
- i in a later block than j: a is g at the last row of j's block, between the two (g does not increase along
  the chunk), so both factors are <= 1 (underflow only where the true value is below 2^-126). For each block
  boundary one [C, 16] x [16, BK] product for the rows after it (r, dq) and one for the columns before it (t).
Products in TF32 (fp32 operands, as fla's off-diagonal sub-chunk products), accumulation in fp32.

db gets one fp32 partial per K-block (a [NK, B, T, H] workspace the launcher sums in a fixed order), as fla.

Rejected: fla's 16-row programs (the layout above re-reads nothing); one anchor per chunk (2^(g_i - a)
overflows past ~17 tokens at the bound); t by column block with [16, BK] results (Triton cannot add a 16-row
tile into a 64-row accumulator; by row block the products land on all 64 rows, masked).
"""

from __future__ import annotations

import torch

from moontrain.model.kda.dqkg import prepare_chunk_indices
from moontrain.model.kda.intra import CHUNK, validate

try:
    import triton
    import triton.language as tl

    from moontrain.model.kda.dqkg_kernel import _program_chunk
except ImportError:  # the specification runs without triton; kda_intra needs it
    triton = None

BLOCK = 16  # rows of a sub-chunk: the diagonal blocks' anchors are at most 8 tokens away


if triton is not None:
    def _configs() -> list:
        tiles = [(32, 4), (64, 4), (64, 8), (128, 8), (32, 2)]
        return [triton.Config({"BK": bk}, num_warps=w, num_stages=1) for bk, w in tiles]

    def _fit(configs: list, named_args: dict, **kwargs) -> list:
        return [c for c in configs if c.kwargs["BK"] <= kwargs["K"]]

    @triton.jit(do_not_specialize=["T"])
    def _intra_kernel(q, k, g, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, dg2, db_part, cu_seqlens, chunk_indices,
                      T, NT, TOKENS, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, IS_VARLEN: tl.constexpr):
        NK: tl.constexpr = K // BK
        NC: tl.constexpr = BT // BC
        i_h, i_k, row, tok0, n_t = _program_chunk(cu_seqlens, chunk_indices, T, NT, H, NK, BT, IS_VARLEN)
        if row >= 0:
            at_k = tok0 * (H * K) + i_h * K + i_k * BK
            q, k, g = q + at_k, k + at_k, g + at_k
            dq, dk, dg, dq2, dk2, dg2 = dq + at_k, dk + at_k, dg + at_k, dq2 + at_k, dk2 + at_k, dg2 + at_k
            at_a = tok0 * (H * BT) + i_h * BT
            dAqk, dAkk = dAqk + at_a, dAkk + at_a
            beta = beta + tok0 * H + i_h
            db_part = db_part + i_k * TOKENS * H + tok0 * H + i_h
            o_t = tl.arange(0, BT)
            m_t = o_t < n_t
            o_k = tl.arange(0, BK)
            p_tk = o_t[:, None] * (H * K) + o_k[None, :]
            m_tk = m_t[:, None]
            b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
            b_kb = b_k * b_beta[:, None]

            # pairs inside one block: anchor at the middle of the block's valid rows
            first = (o_t // BC) * BC
            mid = (first + tl.minimum(first + BC, n_t) - 1) // 2
            b_d = tl.where(m_tk, b_g - tl.load(g + mid[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0), 0.0)
            e_up = tl.exp2(b_d)
            e_dn = tl.exp2(-b_d)
            same = (first[:, None] == first[None, :]) & m_t[:, None] & m_t[None, :]
            p_A = o_t[:, None] * (H * BT) + o_t[None, :]
            b_D = tl.load(dAqk + p_A, mask=m_tk, other=0.0).to(tl.float32)
            b_D = tl.where(same & (o_t[:, None] >= o_t[None, :]), b_D, 0.0)
            b_kdn = b_k * e_dn
            acc_q = tl.dot(b_D, b_kdn) * e_up
            acc_t = tl.dot(tl.trans(b_D), b_q * e_up)
            b_D = tl.load(dAkk + p_A, mask=m_tk, other=0.0).to(tl.float32)
            b_D = tl.where(same & (o_t[:, None] > o_t[None, :]), b_D, 0.0)
            acc_r = tl.dot(b_D, b_kdn) * e_up
            acc_t = tl.dot(tl.trans(b_D), b_kb * e_up, acc_t) * e_dn

            # pairs across a block boundary: anchor at the last row before it
            for c in tl.static_range(NC - 1):
                edge = (c + 1) * BC  # first row after the boundary
                if edge < n_t:
                    b_a = tl.load(g + (edge - 1) * (H * K) + o_k).to(tl.float32)
                    before = o_t < edge
                    # r and dq of the rows after the boundary from the columns of the block before it
                    o_j = edge - BC + tl.arange(0, BC)
                    p_jk = o_j[:, None] * (H * K) + o_k[None, :]
                    b_kj = tl.load(k + p_jk).to(tl.float32) * tl.exp2(b_a[None, :] - tl.load(g + p_jk))
                    m_after = (~before & m_t)[:, None]
                    e_after = tl.where(m_after, tl.exp2(b_g - b_a[None, :]), 0.0)
                    p_Aj = o_t[:, None] * (H * BT) + o_j[None, :]
                    acc_q += tl.dot(tl.load(dAqk + p_Aj, mask=m_after, other=0.0).to(tl.float32), b_kj) * e_after
                    acc_r += tl.dot(tl.load(dAkk + p_Aj, mask=m_after, other=0.0).to(tl.float32), b_kj) * e_after
                    # t of the columns before the boundary from the rows of the block after it
                    o_i = edge + tl.arange(0, BC)
                    m_i = o_i < n_t
                    p_ik = o_i[:, None] * (H * K) + o_k[None, :]
                    e_i = tl.where(m_i[:, None], tl.exp2(tl.load(g + p_ik, mask=m_i[:, None], other=0.0) - b_a[None, :]),
                                   0.0)
                    b_qi = tl.load(q + p_ik, mask=m_i[:, None], other=0.0).to(tl.float32) * e_i
                    b_bi = tl.load(beta + o_i * H, mask=m_i, other=0.0).to(tl.float32)
                    b_kbi = tl.load(k + p_ik, mask=m_i[:, None], other=0.0).to(tl.float32) * b_bi[:, None] * e_i
                    p_Ai = o_i[None, :] * (H * BT) + o_t[:, None]  # [columns j, rows i]: dA transposed
                    m_Ai = before[:, None] & m_i[None, :]
                    b_ti = tl.dot(tl.load(dAqk + p_Ai, mask=m_Ai, other=0.0).to(tl.float32), b_qi)
                    b_ti = tl.dot(tl.load(dAkk + p_Ai, mask=m_Ai, other=0.0).to(tl.float32), b_kbi, b_ti)
                    acc_t += b_ti * tl.where(before[:, None], tl.exp2(b_a[None, :] - b_g), 0.0)

            tl.store(dq2 + p_tk, tl.load(dq + p_tk, mask=m_tk, other=0.0) + acc_q, mask=m_tk)
            b_dg = b_q * acc_q
            tl.store(db_part + o_t * H, tl.sum(acc_r * b_k, axis=1), mask=m_t)
            acc_r *= b_beta[:, None]
            b_dg += (acc_r - acc_t) * b_k
            tl.store(dg2 + p_tk, tl.load(dg + p_tk, mask=m_tk, other=0.0) + b_dg, mask=m_tk)
            tl.store(dk2 + p_tk, tl.load(dk + p_tk, mask=m_tk, other=0.0) + acc_r + acc_t, mask=m_tk)

    _intra_tuned = triton.autotune(configs=_configs(), key=["H", "K", "BT", "IS_VARLEN"],
                                   prune_configs_by={"early_config_prune": _fit})(_intra_kernel)


def kda_intra(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, dAqk: torch.Tensor,
              dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, db: torch.Tensor, dg: torch.Tensor,
              cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
              chunk_size: int = CHUNK, safe_gate: bool = False, lower_bound: float | None = None,
              use_graph: bool = False) -> tuple[torch.Tensor, ...]:
    """fla's chunk_kda_bwd_intra on this module's kernel, same keyword arguments and outputs (dq, dk, db, dg:
    fp32, freshly allocated). safe_gate must be True (the gate bounded: see the module docstring; fla's kernel
    takes unbounded gates); lower_bound and use_graph are accepted for fla's signature (padding rows of
    chunk_indices are always skipped)."""
    if triton is None:
        raise ValueError("kda_intra: triton is not installed; use moontrain.model.kda.intra.kda_intra_reference "
                         "(the PyTorch specification)")
    if not safe_gate:
        raise ValueError("kda_intra: safe_gate=False (an unbounded gate); the kernel factors 2^(g_i - g_j) and "
                         "needs every token's log-decay >= -10 (model.kda_gate_lower_bound); use fla's "
                         "chunk_kda_bwd_intra")
    validate(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, chunk_size)
    for name, t in dict(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg).items():
        if not t.is_contiguous():
            raise ValueError(f"kda_intra: {name} is not contiguous (strides {t.stride()}); call .contiguous()")
    if any(x.dtype != torch.float32 for x in (dq, dk, db, dg)):
        raise ValueError("kda_intra: dq, dk, db and dg must be fp32 on the kernel (fp64 runs on the specification)")
    B, T, H, K = k.shape
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    NT = triton.cdiv(T, CHUNK)
    grid_t = NT if cu_seqlens is None else chunk_indices.shape[0]
    dq2, dk2, dg2 = torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(dg)
    max_nk = K // min(c.kwargs["BK"] for c in _fit(_intra_tuned.configs, {}, K=K))
    db_part = torch.zeros((max_nk, B, T, H), dtype=torch.float32, device=q.device)
    _intra_tuned[lambda meta: (grid_t * (K // meta["BK"]), B * H)](
        q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, dg=dg, dq2=dq2, dk2=dk2, dg2=dg2,
        db_part=db_part, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, NT=NT, TOKENS=B * T, H=H, K=K,
        BT=CHUNK, BC=BLOCK, IS_VARLEN=cu_seqlens is not None)
    nk = K // _intra_tuned.best_config.kwargs["BK"]
    return dq2, dk2, db + db_part[:nk].sum(0), dg2
