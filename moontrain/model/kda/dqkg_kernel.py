"""KDA's chunked backward, the WY / inter-chunk stage (fla-core's chunk_kda_bwd_wy_dqkg_fused) as two Triton
kernels behind one launcher with fla's arguments and outputs; moontrain.model.kda.dqkg is the specification
they match (its docstring: the formulas, the legend and the contract).

Kernels. fla's kernel runs one program per (chunk, head) that loops over K blocks and, inside, V blocks,
holding dq, dk, dw and dA in registers: 4096 programs at B=4, T=4096, H=16, latency-bound (1.344 ms on an
H200). Here the stage is split in two:
- _kblock_kernel, one program per (chunk, K-block, head): the V loop of three MMAs into dq, dk_h, dw
  ([C, BK] fp32 each), then dq, dk, dg of its K columns (complete: they need no other K-block), and its
  partials -dw kg^T ([C, C]) and sum_k dkgb kg ([C]) written to fp32 workspaces, one slot per K-block.
  The K-blocks of a chunk are adjacent in launch order, so the second reads of do, v_new and dv hit L2.
- _finish_kernel, one program per (chunk, head): sums the NK partials in a fixed order (deterministic,
  no atomics), adds the V part (dv v^T, dv2 = beta A^T dv and its db term, over V blocks) and applies
  the masks, the beta scaling and the two products with A^T.
MMA operands are in the inputs' dtype (fp32 partials cast to A's dtype before meeting A, as fla does),
accumulation in fp32. Tiles (BK, BV, warps, stages) are autotuned per (H, K, V, BT, documents or not) and
dtype; the workspace is sized for the smallest BK, and the finish kernel reads NK from the BK the autotuner
chose. Measured against fla's kernel by benchmarks/bench_kda_bwd.py (docs/kda.md); ptxas
(benchmarks/diagnostics/kernel_registers.py) finds the first kernel spill-free at 8 warps where fla's spills.

Rejected: atomics into dA (order-dependent sums); one program per (chunk, head) with the K loop outside
(fla's shape: 4 live [C, C]-sized accumulators, serial over K x V); storing dw and contracting it with kg
in the finish kernel (a [B, T, H, K] round trip and the finish kernel serial over K again).
"""

from __future__ import annotations

import torch

from moontrain.model.kda.dqkg import CHUNK, prepare_chunk_indices, validate

try:
    import triton
    import triton.language as tl
except ImportError:  # the specification runs without triton; kda_dqkg needs it
    triton = None


if triton is not None:
    def _kblock_configs() -> list:
        tiles = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 64, 8, 3), (64, 32, 4, 2), (64, 32, 4, 3),
                 (32, 64, 4, 2), (32, 64, 2, 3), (32, 32, 2, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2)]
        return [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s) for bk, bv, w, s in tiles]

    def _finish_configs() -> list:
        tiles = [(32, 2), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]
        return [triton.Config({"BV": bv}, num_warps=w, num_stages=2) for bv, w in tiles]

    def _fit(configs: list, named_args: dict, **kwargs) -> list:
        """The configs whose tiles fit the head dims (K, V >= 32, so some always do)."""
        K, V = kwargs["K"], kwargs["V"]
        return [c for c in configs if c.kwargs.get("BK", 16) <= K and c.kwargs["BV"] <= V]

    @triton.jit
    def _program_chunk(cu_seqlens, chunk_indices, T, NT, H: tl.constexpr, SPLIT: tl.constexpr, BT: tl.constexpr,
                       IS_VARLEN: tl.constexpr):
        """This program's (head, split, row of the chunk list, first token of the chunk in the flattened [B * T]
        tokens, its number of tokens) on the grid (chunks x SPLIT, B * H); row < 0 for a padding row of the
        chunk list (nothing to do)."""
        pid = tl.program_id(0).to(tl.int64)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        pid_t = pid // SPLIT
        if IS_VARLEN:
            i_n = tl.load(chunk_indices + pid_t * 2).to(tl.int64)
            i_t = tl.load(chunk_indices + pid_t * 2 + 1).to(tl.int64)
            safe_n = tl.maximum(i_n, 0)
            bos = tl.load(cu_seqlens + safe_n).to(tl.int64)
            seq_len = tl.load(cu_seqlens + safe_n + 1).to(tl.int64) - bos
            row = tl.where(i_n < 0, -1, pid_t)
        else:
            i_t = pid_t
            bos = i_b * T
            seq_len = T.to(tl.int64)
            row = i_b * NT + pid_t
        return i_h, pid % SPLIT, row, bos + i_t * BT, tl.minimum(seq_len - i_t * BT, BT).to(tl.int32)

    # Addressing: every base pointer is moved to the program's chunk, head and state with int64 scalars; tile
    # offsets are int32 (a [64, 64] tile of int64 offsets costs 64 registers a thread at 4 warps).

    @triton.jit(do_not_specialize=["T"])
    def _kblock_kernel(q, k, v_new, g, beta, A, h, do, dh, dv, dq, dk, dg, dA_part, db_part, cu_seqlens,
                       chunk_indices, scale, T, NT, R,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
        NK: tl.constexpr = K // BK
        i_h, i_k, row, tok0, n_t = _program_chunk(cu_seqlens, chunk_indices, T, NT, H, NK, BT, IS_VARLEN)
        if row >= 0:
            at_k = tok0 * (H * K) + i_h * K + i_k * BK  # the chunk's first row, this head and K-block
            q, k, g, dq, dk, dg = q + at_k, k + at_k, g + at_k, dq + at_k, dk + at_k, dg + at_k
            at_v = tok0 * (H * V) + i_h * V
            v_new, do, dv = v_new + at_v, do + at_v, dv + at_v
            state = (row * H + i_h) * (K * V) + i_k * BK * V
            h, dh = h + state, dh + state
            o_t = tl.arange(0, BT)
            m_t = o_t < n_t
            o_k = tl.arange(0, BK)

            b_dq = tl.zeros([BT, BK], dtype=tl.float32)
            b_dk = tl.zeros([BT, BK], dtype=tl.float32)
            b_dw = tl.zeros([BT, BK], dtype=tl.float32)
            b_hdh = tl.zeros([BK], dtype=tl.float32)
            for v0 in range(0, V, BV):
                p_tv = o_t[:, None] * (H * V) + (v0 + tl.arange(0, BV))[None, :]
                b_do = tl.load(do + p_tv, mask=m_t[:, None], other=0.0)
                b_vn = tl.load(v_new + p_tv, mask=m_t[:, None], other=0.0)
                b_dv = tl.load(dv + p_tv, mask=m_t[:, None], other=0.0)
                p_hT = o_k[None, :] * V + (v0 + tl.arange(0, BV))[:, None]  # h^T tile [BV, BK]
                b_hT = tl.load(h + p_hT)
                b_dhT = tl.load(dh + p_hT)
                b_hdh += tl.sum(b_hT.to(tl.float32) * b_dhT.to(tl.float32), axis=0)
                b_dq = tl.dot(b_do, b_hT.to(b_do.dtype), b_dq)
                b_dk = tl.dot(b_vn, b_dhT.to(b_vn.dtype), b_dk)
                b_dw = tl.dot(b_dv, b_hT.to(b_dv.dtype), b_dw)

            # the epilogue stores each result as soon as it is final, so each [C, BK] tile dies early
            p_tk = o_t[:, None] * (H * K) + o_k[None, :]
            m_tk = m_t[:, None]
            b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_eg = tl.exp2(b_g)
            b_dq = b_dq * b_eg * scale
            tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
            b_dg = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32) * b_dq

            b_gn = tl.load(g + (n_t - 1) * (H * K) + o_k).to(tl.float32)
            b_dk = b_dk * tl.where(m_tk, tl.exp2(b_gn[None, :] - b_g), 0.0)
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_kdk = b_k * b_dk
            b_dg -= b_kdk
            b_dgn = b_hdh * tl.exp2(b_gn) + tl.sum(b_kdk, axis=0)
            b_dg = tl.where((o_t == n_t - 1)[:, None], b_dg + b_dgn[None, :], b_dg)
            b_kg = b_k * b_eg

            o_c = tl.arange(0, BT)
            b_A = tl.load(A + tok0 * (H * BT) + i_h * BT + o_t[:, None] * (H * BT) + o_c[None, :], mask=m_tk,
                          other=0.0)
            b_dw = (-b_dw).to(b_A.dtype)
            slot = (i_k * R + row) * H + i_h
            b_dA = tl.dot(b_dw, tl.trans(b_kg.to(b_A.dtype)))
            tl.store(dA_part + slot * (BT * BT) + o_t[:, None] * BT + o_c[None, :], b_dA)
            b_dkgb = tl.dot(tl.trans(b_A), b_dw)  # A^T dw
            tl.store(db_part + slot * BT + o_t, tl.sum(b_dkgb * b_kg, axis=1))
            b_beta = tl.load(beta + (tok0 * H + i_h) + o_t * H, mask=m_t, other=0.0).to(tl.float32)
            b_dkgb *= b_beta[:, None]
            b_dg += b_kg * b_dkgb
            tl.store(dg + p_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)
            b_dk += b_dkgb * b_eg
            tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)

    @triton.jit(do_not_specialize=["T"])
    def _finish_kernel(v, beta, A, dv, dv2, db, dA, dA_part, db_part, cu_seqlens, chunk_indices, T, NT, R,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr,
                       BV: tl.constexpr, IS_VARLEN: tl.constexpr):
        i_h, _, row, tok0, n_t = _program_chunk(cu_seqlens, chunk_indices, T, NT, H, 1, BT, IS_VARLEN)
        if row >= 0:
            at_v = tok0 * (H * V) + i_h * V
            v, dv, dv2 = v + at_v, dv + at_v, dv2 + at_v
            at_a = tok0 * (H * BT) + i_h * BT
            A, dA = A + at_a, dA + at_a
            beta, db = beta + tok0 * H + i_h, db + tok0 * H + i_h
            o_t = tl.arange(0, BT)
            m_t = o_t < n_t
            p_A = o_t[:, None] * (H * BT) + o_t[None, :]
            b_A = tl.load(A + p_A, mask=m_t[:, None], other=0.0)
            b_At = tl.trans(b_A)
            b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)

            b_dA = tl.zeros([BT, BT], dtype=tl.float32)
            b_db = tl.zeros([BT], dtype=tl.float32)
            for i_k in tl.static_range(NK):  # fixed order: the sums do not depend on scheduling
                slot = (i_k * R + row) * H + i_h
                b_dA += tl.load(dA_part + slot * (BT * BT) + o_t[:, None] * BT + o_t[None, :])
                b_db += tl.load(db_part + slot * BT + o_t)
            for v0 in range(0, V, BV):
                p_tv = o_t[:, None] * (H * V) + (v0 + tl.arange(0, BV))[None, :]
                b_v = tl.load(v + p_tv, mask=m_t[:, None], other=0.0)
                b_dv = tl.load(dv + p_tv, mask=m_t[:, None], other=0.0)
                b_dA = tl.dot(b_dv, tl.trans(b_v.to(b_dv.dtype)), b_dA)
                b_dvb = tl.dot(b_At, b_dv.to(b_A.dtype))  # A^T dv
                b_db += tl.sum(b_dvb * b_v.to(tl.float32), axis=1)
                tl.store(dv2 + p_tv, (b_dvb * b_beta[:, None]).to(dv2.dtype.element_ty), mask=m_t[:, None])

            m_A = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
            b_dA = tl.where(m_A, b_dA * b_beta[None, :], 0.0)
            b_dA = tl.dot(b_dA.to(b_A.dtype), b_At)
            b_dA = tl.dot(b_At, b_dA.to(b_A.dtype))
            b_dA = tl.where(m_A, -b_dA, 0.0)
            tl.store(dA + p_A, b_dA.to(dA.dtype.element_ty), mask=m_t[:, None])
            tl.store(db + o_t * H, b_db.to(db.dtype.element_ty), mask=m_t)

    # cache_results: the choice is kept in Triton's cache, so every run on a machine takes the same tiles (and the
    # same sums), and the shipped choices (moontrain.trainer.kernel_cache) spare a fresh machine the search
    _kblock_tuned = triton.autotune(configs=_kblock_configs(), key=["H", "K", "V", "BT", "IS_VARLEN"],
                                    prune_configs_by={"early_config_prune": _fit}, cache_results=True)(_kblock_kernel)
    _finish_tuned = triton.autotune(configs=_finish_configs(), key=["H", "K", "V", "BT", "NK", "IS_VARLEN"],
                                    prune_configs_by={"early_config_prune": _fit}, cache_results=True)(_finish_kernel)


def kda_dqkg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
             dv: torch.Tensor, scale: float | None = None, state_v_first: bool = False,
             cu_seqlens: torch.Tensor | None = None, chunk_size: int = CHUNK,
             chunk_indices: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None,
             use_graph: bool = False, dqk_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """fla's chunk_kda_bwd_wy_dqkg_fused on this module's kernels, same keyword arguments and outputs:
    (dq fp32 [B, T, H, K], dk fp32, dv2 in v's dtype [B, T, H, V], db fp32 [B, T, H], dg fp32, dA fp32
    [B, T, H, 64]), freshly allocated. chunk_offsets and use_graph are accepted for fla's signature: the
    kernels need neither (padding rows of chunk_indices are always skipped). dqk_dtype: dq's and dk's, fp32 (fla's)
    or q's dtype (their fp32 values rounded once, for moontrain.model.kda.intra_norm_kernel, which reads them
    once: docs/kda.md)."""
    if triton is None:
        raise ValueError("kda_dqkg: triton is not installed; use moontrain.model.kda.dqkg.kda_dqkg_reference (the "
                         "PyTorch specification)")
    validate(q, k, v, g, beta, A, h, state_v_first, cu_seqlens, chunk_size, chunk_indices)
    if dqk_dtype not in (torch.float32, q.dtype):
        raise ValueError(f"kda_dqkg: dqk_dtype={dqk_dtype}; give torch.float32 or q's dtype ({q.dtype})")
    tensors = dict(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv)
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"kda_dqkg: {name} is not contiguous (strides {t.stride()}); call .contiguous()")
    if v_new.shape != v.shape or do.shape != v.shape or dv.shape != v.shape or dh.shape != h.shape:
        raise ValueError(f"kda_dqkg: v_new {tuple(v_new.shape)}, do {tuple(do.shape)}, dv {tuple(dv.shape)} must "
                         f"match v {tuple(v.shape)} and dh {tuple(dh.shape)} h {tuple(h.shape)}")
    B, T, H, K, V = *k.shape, v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    NT = triton.cdiv(T, CHUNK)
    R = B * NT if cu_seqlens is None else chunk_indices.shape[0]
    grid_t = NT if cu_seqlens is None else R  # programs per head row of the grid
    dq = torch.empty(q.shape, dtype=dqk_dtype, device=q.device)
    dk = torch.empty_like(dq)
    dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    dv2 = torch.empty_like(v)
    db = torch.empty(beta.shape, dtype=torch.float32, device=beta.device)
    dA = torch.empty(A.shape, dtype=torch.float32, device=A.device)
    max_nk = K // min(c.kwargs["BK"] for c in _fit(_kblock_tuned.configs, {}, K=K, V=V))
    dA_part = torch.empty((max_nk, R, H, CHUNK, CHUNK), dtype=torch.float32, device=q.device)
    db_part = torch.empty((max_nk, R, H, CHUNK), dtype=torch.float32, device=q.device)
    common = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, NT=NT, R=R, H=H, K=K, V=V, BT=CHUNK,
                  IS_VARLEN=cu_seqlens is not None)
    _kblock_tuned[lambda meta: (grid_t * (K // meta["BK"]), B * H)](
        q=q, k=k, v_new=v_new, g=g, beta=beta, A=A, h=h, do=do, dh=dh, dv=dv, dq=dq, dk=dk, dg=dg,
        dA_part=dA_part, db_part=db_part, scale=scale, **common)
    nk = K // _kblock_tuned.best_config.kwargs["BK"]
    _finish_tuned[(grid_t, B * H)](v=v, beta=beta, A=A, dv=dv, dv2=dv2, db=db, dA=dA, dA_part=dA_part,
                                   db_part=db_part, NK=nk, **common)
    return dq, dk, dv2, db, dg, dA
