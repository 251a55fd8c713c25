"""KDA's intra-chunk backward stage and the L2 norms' backward as one Triton kernel (kernels.kda_intra=moontrain,
with kernels.kda_gate_norm=moontrain); its specification, moontrain.model.kda.intra_norm, is the two stages it
fuses, composed: moontrain.model.kda.intra (dq, dk, db, dg from the dqkg stage's) then the norms' part of
moontrain.model.kda.gate_norm's backward (dq_in = q_rstd (dq - (dq . qn) qn), dk_in likewise).

Why fused. On the default route fla's intra kernel writes fp32 dq, dk and dg ([B, T, H, K] each) and the ends'
backward reads them back to apply the norms; a program that holds whole rows (all K columns) can apply the norms
before it stores, so dq and dk leave once, in q's dtype, and the ends' backward is left the gate alone (dg and f
in, df out: moontrain.model.kda.gate_norm_kernel with its norms off).

Kernel. One program per (16-row sub-chunk, chunk, head), every K column ([16, K] tiles, fp32 accumulators of 16
values a thread at K = 128 and 4 warps), as fla's kernel splits the chunk but without its K-blocks. With E_ij =
2^(g_i - g_j) (g the chunk-local cumulative log2 gate, non-increasing along the chunk):
- the rows' own sums over earlier sub-chunks J: dq_i += sum_j dAqk_ij k_j E_ij and r_i = sum_j dAkk_ij k_j E_ij
  as [16, 16] x [16, K] products of k_J 2^(g_ref - g_J), g_ref the sub-chunk's first row, then times
  2^(g_i - g_ref) (both factors <= 1);
- the sums over later sub-chunks S for the rows as the column index: t_j = sum_i dAqk_ij q_i E_ij + dAkk_ij
  beta_i k_i E_ij, through q_S 2^(g_S - g_ref') with g_ref' the sub-chunk's last row, then times 2^(g_ref' - g_j);
- the diagonal [16, 16] block through its middle row's gate: both factors within 2^(8 |lower bound| / ln 2),
  finite in fp32 for a lower bound down to -10 (the gate must be bounded: kernels.kda_intra=fla_k64 otherwise).
Every product runs in TF32 (fla's kernel: its off-diagonal ones; its diagonal ones in bf16x3): each operand is
rounded relative to itself, so a diagonal term's two factors (2^58 and 2^-58 at most at the recipe's bound)
cost no more than an off-diagonal term's.
Then dq, dk, dg, db gain their parts (moontrain.model.kda.intra's formulas) and the norms' backward is applied to
dq and dk in the registers. dq and dk come in fp32 (fla's dqkg stage) or in q's dtype (moontrain's on this route,
moontrain.model.kda.chunk: half their bytes written and read; docs/kda.md measures the cost in accuracy). Rows of
the chunk list with a negative sequence (fla's use_graph padding) and sub-chunks past a chunk's end do nothing.
"""

from __future__ import annotations

import torch

from moontrain.model.kda.dqkg import CHUNK, prepare_chunk_indices
from moontrain.model.kda.intra import validate
from moontrain.model.kda.intra_norm import check_lower_bound

try:
    import triton
    import triton.language as tl

    from moontrain.model.kda.dqkg_kernel import _program_chunk
except ImportError:  # the specifications run without triton; the launcher needs it
    triton = None

SUB = 16  # rows of a sub-chunk (fla's BC)
DIAG = "tf32"  # the diagonal blocks' products, as the others (docs/kda.md: against "ieee", fp32 FMA)
# ptxas's register cap a thread at K <= 128: three programs of 4 warps an SM (64k registers; uncapped the kernel
# takes ~240 and two fit), measured faster on an H100 with 160 B spilled (docs/performance.md); 128 (four) spills
# more and is slower. At K = 256 the rows need more than the cap: uncapped there
MAXNREG = 168


if triton is not None:
    @triton.jit
    def _exp2_rows(a, b, valid):
        """2^(a - b) on the valid rows, 0 elsewhere (no inf * 0 from a masked row's gate)."""
        return tl.where(valid, tl.exp2(tl.where(valid, a - b, 0.0)), 0.0)

    @triton.jit(do_not_specialize=["T"])
    def _intra_norm_kernel(q, k, g, beta, dAqk, dAkk, dq, dk, dg, db, q_rstd, k_rstd, dq_out, dk_out, dg_out,
                           db_out, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr, K: tl.constexpr,
                           BT: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr, DIAG: tl.constexpr):
        NC: tl.constexpr = BT // BC
        i_h, i_s, row, tok0, n_t = _program_chunk(cu_seqlens, chunk_indices, T, NT, H, NC, BT, IS_VARLEN)
        c0 = i_s * BC  # the sub-chunk's first row in its chunk
        if (row >= 0) & (c0 < n_t):
            at = tok0 * (H * K) + i_h * K  # the chunk's first row, this head, in the [B, T, H, K] tensors
            at_a = tok0 * (H * BT) + i_h * BT  # in the [B, T, H, BT] dA tensors
            at_r = tok0 * H + i_h  # in the [B, T, H] tensors
            o_i = tl.arange(0, BC)
            o_k = tl.arange(0, K)
            c_I = c0 + o_i
            m_I = c_I < n_t
            m = m_I[:, None]
            p_I = c_I[:, None] * (H * K) + o_k[None, :]

            # the rows' sums over the earlier sub-chunks (every row of those is inside the chunk)
            b_dq = tl.zeros([BC, K], dtype=tl.float32)
            b_r = tl.zeros([BC, K], dtype=tl.float32)
            b_gref = tl.load(g + at + c0 * (H * K) + o_k)
            for j_s in range(0, i_s):
                c_J = j_s * BC + o_i
                p_J = c_J[:, None] * (H * K) + o_k[None, :]
                b_kg = tl.load(k + at + p_J).to(tl.float32) * tl.exp2(b_gref[None, :] - tl.load(g + at + p_J))
                p_A = c_I[:, None] * (H * BT) + c_J[None, :]
                b_dq = tl.dot(tl.load(dAqk + at_a + p_A, mask=m, other=0.0), b_kg, b_dq)
                b_r = tl.dot(tl.load(dAkk + at_a + p_A, mask=m, other=0.0), b_kg, b_r)
            b_gI = tl.load(g + at + p_I, mask=m, other=0.0)
            b_eI = _exp2_rows(b_gI, b_gref[None, :], m)
            b_dq *= b_eI
            b_r *= b_eI

            # the diagonal block, through its middle row's gate
            b_gmid = tl.load(g + at + tl.minimum(c0 + BC // 2 - 1, n_t - 1) * (H * K) + o_k)
            b_up = _exp2_rows(b_gI, b_gmid[None, :], m)  # 2^(g_i - g_mid)
            b_down = _exp2_rows(b_gmid[None, :], b_gI, m)  # 2^(g_mid - g_j)
            p_D = c_I[:, None] * (H * BT) + c_I[None, :]
            m_D = m & m_I[None, :]
            b_Dq = tl.where(m_D & (o_i[:, None] >= o_i[None, :]), tl.load(dAqk + at_a + p_D, mask=m_D, other=0.0), 0.0)
            b_Dk = tl.where(m_D & (o_i[:, None] > o_i[None, :]), tl.load(dAkk + at_a + p_D, mask=m_D, other=0.0), 0.0)
            b_kd = tl.load(k + at + p_I, mask=m, other=0.0).to(tl.float32) * b_down
            b_dq += tl.dot(b_Dq, b_kd, input_precision=DIAG) * b_up
            b_r += tl.dot(b_Dk, b_kd, input_precision=DIAG) * b_up
            b_qu = tl.load(q + at + p_I, mask=m, other=0.0).to(tl.float32) * b_up
            b_t = tl.dot(tl.trans(b_Dq), b_qu, input_precision=DIAG)
            b_bI = tl.load(beta + at_r + c_I * H, mask=m_I, other=0.0).to(tl.float32)
            b_ku = tl.load(k + at + p_I, mask=m, other=0.0).to(tl.float32) * (b_up * b_bI[:, None])
            b_t = tl.dot(tl.trans(b_Dk), b_ku, b_t, input_precision=DIAG)
            b_t *= b_down

            # the rows as the column index of the later sub-chunks' sums (only a whole sub-chunk has later rows)
            if c0 + BC < n_t:
                b_gref = tl.load(g + at + (c0 + BC - 1) * (H * K) + o_k)
                b_tS = tl.zeros([BC, K], dtype=tl.float32)
                for s_s in range(i_s + 1, tl.cdiv(n_t, BC)):
                    c_S = s_s * BC + o_i
                    m_S = (c_S < n_t)[:, None]
                    p_S = c_S[:, None] * (H * K) + o_k[None, :]
                    b_eS = _exp2_rows(tl.load(g + at + p_S, mask=m_S, other=0.0), b_gref[None, :], m_S)
                    p_A = c_S[:, None] * (H * BT) + c_I[None, :]
                    b_qS = tl.load(q + at + p_S, mask=m_S, other=0.0).to(tl.float32) * b_eS
                    b_tS = tl.dot(tl.trans(tl.load(dAqk + at_a + p_A, mask=m_S, other=0.0)), b_qS, b_tS)
                    b_bS = tl.load(beta + at_r + c_S * H, mask=c_S < n_t, other=0.0).to(tl.float32)
                    b_kS = tl.load(k + at + p_S, mask=m_S, other=0.0).to(tl.float32) * (b_eS * b_bS[:, None])
                    b_tS = tl.dot(tl.trans(tl.load(dAkk + at_a + p_A, mask=m_S, other=0.0)), b_kS, b_tS)
                b_t += b_tS * _exp2_rows(b_gref[None, :], tl.load(g + at + p_I, mask=m, other=0.0), m)

            # the stage's sums, then the norms' backward on dq and dk
            b_kI = tl.load(k + at + p_I, mask=m, other=0.0).to(tl.float32)
            tl.store(db_out + at_r + c_I * H, tl.load(db + at_r + c_I * H, mask=m_I, other=0.0) +
                     tl.sum(b_r * b_kI, axis=1), mask=m_I)
            b_r *= tl.load(beta + at_r + c_I * H, mask=m_I, other=0.0).to(tl.float32)[:, None]
            b_qI = tl.load(q + at + p_I, mask=m, other=0.0).to(tl.float32)
            b_dg = tl.load(dg + at + p_I, mask=m, other=0.0) + b_qI * b_dq + (b_r - b_t) * b_kI
            tl.store(dg_out + at + p_I, b_dg, mask=m)
            b_dq += tl.load(dq + at + p_I, mask=m, other=0.0).to(tl.float32)
            b_rs = tl.load(q_rstd + at_r + c_I * H, mask=m_I, other=0.0)
            b_dq = b_rs[:, None] * (b_dq - tl.sum(b_dq * b_qI, axis=1)[:, None] * b_qI)
            tl.store(dq_out + at + p_I, b_dq.to(dq_out.dtype.element_ty), mask=m)
            b_dk = tl.load(dk + at + p_I, mask=m, other=0.0).to(tl.float32) + b_r + b_t
            b_rs = tl.load(k_rstd + at_r + c_I * H, mask=m_I, other=0.0)
            b_dk = b_rs[:, None] * (b_dk - tl.sum(b_dk * b_kI, axis=1)[:, None] * b_kI)
            tl.store(dk_out + at + p_I, b_dk.to(dk_out.dtype.element_ty), mask=m)


def _register_cap(maxnreg: int | None, K: int) -> dict:
    """The launch's maxnreg option: none where uncapped (0, or None at K > 128)."""
    if maxnreg is None:
        maxnreg = MAXNREG if K <= 128 else 0
    if maxnreg < 0 or maxnreg % 8 or (maxnreg and maxnreg < 64):
        raise ValueError(f"kda_intra_norm: maxnreg={maxnreg}; give 0 (uncapped) or a multiple of 8 >= 64")
    return dict(maxnreg=maxnreg) if maxnreg else {}


def kda_intra_norm(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, dAqk: torch.Tensor,
                   dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, db: torch.Tensor, dg: torch.Tensor,
                   q_rstd: torch.Tensor, k_rstd: torch.Tensor, *, lower_bound: float | None,
                   cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                   warps: int = 4, stages: int = 3, diag: str = DIAG,
                   maxnreg: int | None = None) -> tuple[torch.Tensor, ...]:
    """The intra-chunk stage (moontrain.model.kda.intra's arguments: q, k the normalised rows as the forward
    stored them) followed by the L2 norms' backward: (dq_in, dk_in in q's dtype, db, dg fp32). dq, dk: fp32 or q's
    dtype. q_rstd, k_rstd: the forward's reciprocal norms (fp32 [B, T, H]); lower_bound: the gate's (required,
    >= -10). warps, stages, diag (the diagonal blocks' input_precision), maxnreg (ptxas's register cap a thread;
    None: MAXNREG at K <= 128, 0: uncapped): the launch's (benchmarks/bench_kda_intra_norm.py sweeps them)."""
    if triton is None:
        raise ValueError("kda_intra_norm: triton is not installed; compose moontrain.model.kda.intra's and "
                         "moontrain.model.kda.gate_norm's references")
    check_lower_bound(lower_bound)
    validate(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens, CHUNK, dqk_in_q_dtype=True)
    named = dict(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, q_rstd=q_rstd,
                 k_rstd=k_rstd)
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"kda_intra_norm: {name} is not contiguous (strides {t.stride()}); call .contiguous()")
    if any(t.dtype != torch.float32 for t in (g, dAqk, dAkk, db, dg, q_rstd, k_rstd)):
        raise ValueError("kda_intra_norm: g, dAqk, dAkk, db, dg, q_rstd and k_rstd must be fp32 (the stages' "
                         "outputs); fp64 runs on the specifications")
    if any(t.dtype not in (torch.float32, q.dtype) or t.dtype == torch.float64 for t in (dq, dk)):
        raise ValueError(f"kda_intra_norm: dq is {dq.dtype} and dk {dk.dtype}; give them in fp32 or q's dtype "
                         f"({q.dtype}); fp64 runs on the specifications")
    B, T, H, K = k.shape
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    NT = triton.cdiv(T, CHUNK)
    rows = NT if cu_seqlens is None else chunk_indices.shape[0]
    dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)
    dg_out, db_out = torch.empty_like(dg), torch.empty_like(db)
    _intra_norm_kernel[(rows * (CHUNK // SUB), B * H)](
        q, k, g, beta, dAqk, dAkk, dq, dk, dg, db, q_rstd, k_rstd, dq_out, dk_out, dg_out, db_out, cu_seqlens,
        chunk_indices, T, NT, H=H, K=K, BT=CHUNK, BC=SUB, IS_VARLEN=cu_seqlens is not None, DIAG=diag,
        num_warps=warps, num_stages=stages, **_register_cap(maxnreg, K))
    return dq_out, dk_out, db_out, dg_out

