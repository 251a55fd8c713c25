"""The two elementwise ends of KDA's chunked call as one Triton kernel each; moontrain.model.kda.gate_norm is the
specification they match (its docstring: the formulas, the legend and the contract).

Kernel. One program per (chunk, head) reads the chunk's [64, K] tiles once, row by row of tokens:
- forward: q and k (their L2 norms and the normalised rows), f (the gate and its chunk-local cumulative sum);
- backward: dg and f (the reverse cumulative sum, the gate's input gradient, and one fp32 partial of dA_log and
  of dt_bias's gradient per program, which the launcher sums in a fixed order), then dq with qn and dk with kn
  (the L2 norms' backward; off in kda_gate_backward, whose caller's intra-chunk kernel applied them). Without the
  norms every column's work is its own, so kda_gate_backward's programs take GATE_BLOCK columns of a chunk each.
q, k and f are read in place at their token stride (a column slice of the projection needs no copy). Rows of the
chunk list with a negative sequence (fla's use_graph padding) mask every load and store and leave zero partials.
"""

from __future__ import annotations

import torch

from moontrain.model.kda.dqkg import CHUNK, prepare_chunk_indices
from moontrain.model.kda.gate_norm import L2_EPS, validate

try:
    import triton
    import triton.language as tl

    from moontrain.model.kda.dqkg_kernel import _program_chunk
except ImportError:  # the specification runs without triton; the launchers need it
    triton = None

# the gate's backward alone (kda_gate_backward): [64, 32] tiles at 2 warps, four programs a chunk at K = 128;
# measured faster than whole rows at 8 warps on an H100 (docs/performance.md)
GATE_BLOCK, GATE_WARPS = 32, 2


if triton is not None:
    @triton.jit
    def _gate(x, a, lower_bound, USE_LOWER_BOUND: tl.constexpr):
        """The log-decay (nats) at x = f + dt_bias and, for the backward, its derivatives by x and by A_log."""
        if USE_LOWER_BOUND:
            s = tl.sigmoid(a * x)
            d_x = lower_bound * s * (1 - s) * a
            return lower_bound * s, d_x, d_x * x
        sp = tl.where(x > 20.0, x, tl.log(1 + tl.exp(tl.minimum(x, 20.0))))
        return -a * sp, -a * tl.sigmoid(x), -a * sp

    @triton.jit
    def _norm(x, y_out, rstd_out, at_y, o_t, o_k, at_r, m_t, m, eps, H: tl.constexpr, K: tl.constexpr):
        """Store the L2-normalised rows of the fp32 tile x and their reciprocal norms."""
        b_r = 1 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
        tl.store(y_out + at_y + o_t[:, None] * (H * K) + o_k[None, :], (x * b_r[:, None]).to(y_out.dtype.element_ty),
                 mask=m)
        tl.store(rstd_out + at_r + o_t * H, b_r, mask=m_t)

    @triton.jit
    def _norm_backward(dy, y, rstd, dx, at_y, o_t, o_k, at_r, m_t, m, H: tl.constexpr, K: tl.constexpr):
        p = at_y + o_t[:, None] * (H * K) + o_k[None, :]
        b_dy = tl.load(dy + p, mask=m, other=0.0)
        b_y = tl.load(y + p, mask=m, other=0.0).to(tl.float32)
        b_r = tl.load(rstd + at_r + o_t * H, mask=m_t, other=0.0)
        b_dx = b_r[:, None] * (b_dy - tl.sum(b_dy * b_y, axis=1)[:, None] * b_y)
        tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["T"])
    def _forward_kernel(q, k, f, A_log, dt_bias, qn, kn, q_rstd, k_rstd, g, cu_seqlens, chunk_indices, lower_bound,
                        eps, T, NT, stride_q, stride_k, stride_f, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                        IS_VARLEN: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, NORMS: tl.constexpr):
        i_h, _, row, tok0, n_t = _program_chunk(cu_seqlens, chunk_indices, T, NT, H, 1, BT, IS_VARLEN)
        o_t = tl.arange(0, BT)
        o_k = tl.arange(0, K)
        m_t = (o_t < n_t) & (row >= 0)
        m = m_t[:, None]
        at_y = tok0 * (H * K) + i_h * K  # the chunk's first row, this head, in the [B, T, H, K] outputs
        at_r = tok0 * H + i_h
        if NORMS:
            b_q = tl.load(q + tok0 * stride_q + i_h * K + o_t[:, None] * stride_q + o_k[None, :], mask=m, other=0.0)
            _norm(b_q.to(tl.float32), qn, q_rstd, at_y, o_t, o_k, at_r, m_t, m, eps, H, K)
            b_k = tl.load(k + tok0 * stride_k + i_h * K + o_t[:, None] * stride_k + o_k[None, :], mask=m, other=0.0)
            _norm(b_k.to(tl.float32), kn, k_rstd, at_y, o_t, o_k, at_r, m_t, m, eps, H, K)
        b_x = tl.load(f + tok0 * stride_f + i_h * K + o_t[:, None] * stride_f + o_k[None, :], mask=m, other=0.0)
        b_x = b_x.to(tl.float32) + tl.load(dt_bias + i_h * K + o_k)[None, :]
        b_gate, _, _ = _gate(b_x, tl.exp(tl.load(A_log + i_h)), lower_bound, USE_LOWER_BOUND)
        b_g = tl.cumsum(tl.where(m, b_gate, 0.0), axis=0) * 1.4426950408889634  # 1 / ln 2
        tl.store(g + at_y + o_t[:, None] * (H * K) + o_k[None, :], b_g, mask=m)

    @triton.jit(do_not_specialize=["T"])
    def _backward_kernel(dq, dk, dg, qn, kn, q_rstd, k_rstd, f, A_log, dt_bias, dq_in, dk_in, df, dA_part,
                         dbias_part, cu_seqlens, chunk_indices, lower_bound, T, NT, stride_f, H: tl.constexpr,
                         K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                         USE_LOWER_BOUND: tl.constexpr, NORMS: tl.constexpr):
        NKB: tl.constexpr = K // BK  # 1 with the norms (they need whole rows)
        i_h, i_k, row, tok0, n_t = _program_chunk(cu_seqlens, chunk_indices, T, NT, H, NKB, BT, IS_VARLEN)
        o_t = tl.arange(0, BT)
        o_k = i_k * BK + tl.arange(0, BK)
        m_t = (o_t < n_t) & (row >= 0)
        m = m_t[:, None]
        at_y = tok0 * (H * K) + i_h * K
        at_r = tok0 * H + i_h
        part = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # this program's dA_log slot
        chunk_part = (tl.program_id(0).to(tl.int64) // NKB) * tl.num_programs(1) + tl.program_id(1)  # dt_bias's row
        b_dg = tl.load(dg + at_y + o_t[:, None] * (H * K) + o_k[None, :], mask=m, other=0.0)
        b_dgate = tl.cumsum(b_dg, axis=0, reverse=True)
        p_f = tok0 * stride_f + i_h * K + o_t[:, None] * stride_f + o_k[None, :]
        b_x = tl.load(f + p_f, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + i_h * K + o_k)[None, :]
        _, d_x, d_a = _gate(b_x, tl.exp(tl.load(A_log + i_h)), lower_bound, USE_LOWER_BOUND)
        b_df = tl.where(m, b_dgate * d_x, 0.0)
        tl.store(df + at_y + o_t[:, None] * (H * K) + o_k[None, :], b_df.to(df.dtype.element_ty), mask=m)
        tl.store(dA_part + part, tl.sum(tl.sum(tl.where(m, b_dgate * d_a, 0.0), axis=1), axis=0))
        tl.store(dbias_part + chunk_part * K + o_k, tl.sum(b_df, axis=0))
        if NORMS:
            _norm_backward(dq, qn, q_rstd, dq_in, at_y, o_t, o_k, at_r, m_t, m, H, K)
            _norm_backward(dk, kn, k_rstd, dk_in, at_y, o_t, o_k, at_r, m_t, m, H, K)


def _token_strided(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [B, T, H, K] and the stride of its flattened tokens, where its heads are K contiguous elements and its
    tokens equally spaced (a column slice of a [B, T, N] projection is); a contiguous copy otherwise."""
    B, T, H, K = x.shape
    if x.stride(3) == 1 and x.stride(2) == K and (B == 1 or x.stride(0) == T * x.stride(1)):
        return x, x.stride(1)
    return x.contiguous(), H * K


def _grid(B: int, T: int, H: int, cu_seqlens: torch.Tensor | None,
          chunk_indices: torch.Tensor | None) -> tuple[torch.Tensor | None, int, tuple[int, int]]:
    """(chunk_indices, chunks of a batch row, the launch grid (chunk rows, B * H))."""
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens)
    NT = triton.cdiv(T, CHUNK)
    return chunk_indices, NT, (NT if cu_seqlens is None else chunk_indices.shape[0], B * H)


def _warps(K: int, warps: int | None) -> int:
    """The launch's warps: `warps` where given (benchmarks/bench_gate_norm.py sweeps them), else 8 for K <= 128 and
    16 above (each warp's share of the [64, K] tiles in registers; at K = 128, 8 warps beat 4 and 16 on an H100:
    docs/performance.md)."""
    if warps is None:
        return 8 if K <= 128 else 16
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"gate_norm kernels: warps must be a power of two in [1, 32], got {warps!r}")
    return warps


def _require_triton(name: str) -> None:
    if triton is None:
        raise ValueError(f"{name}: triton is not installed; use moontrain.model.kda.gate_norm's reference "
                         "functions (the PyTorch specification)")


def kda_gate_norm(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                  lower_bound: float | None, cu_seqlens: torch.Tensor | None = None,
                  chunk_indices: torch.Tensor | None = None, warps: int | None = None) -> tuple[torch.Tensor, ...]:
    """kda_gate_norm_reference on the kernel: (qn, kn in q's dtype; q_rstd, k_rstd [B, T, H] and g fp32). warps:
    the launch's (None: 8 for K <= 128, else 16)."""
    _require_triton("kda_gate_norm")
    validate(q, k, f, A_log, dt_bias, cu_seqlens)
    B, T, H, K = k.shape
    qn, kn = torch.empty(B, T, H, K, dtype=q.dtype, device=q.device), torch.empty(B, T, H, K, dtype=k.dtype,
                                                                                  device=k.device)
    q_rstd, k_rstd = (torch.empty(B, T, H, dtype=torch.float32, device=q.device) for _ in range(2))
    g = _launch_forward(q, k, f, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, (qn, kn, q_rstd, k_rstd),
                        warps)
    return qn, q_rstd, kn, k_rstd, g


def kda_gate_cumsum(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, lower_bound: float | None,
             cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """kda_gate_norm's g alone (the same kernel, its norms switched off): a backward that recomputes the
    forward's states gets the forward's g bit for bit."""
    _require_triton("kda_gate_cumsum")
    validate(f, f, f, A_log, dt_bias, cu_seqlens)
    return _launch_forward(f, f, f, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, None, None)


def _launch_forward(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float | None, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                    norms: tuple[torch.Tensor, ...] | None, warps: int | None) -> torch.Tensor:
    B, T, H, K = f.shape
    (q, sq), (k, sk), (f, sf) = _token_strided(q), _token_strided(k), _token_strided(f)
    chunk_indices, NT, grid = _grid(B, T, H, cu_seqlens, chunk_indices)
    g = torch.empty(B, T, H, K, dtype=torch.float32, device=f.device)
    qn, kn, q_rstd, k_rstd = norms if norms is not None else (g, g, g, g)  # unwritten without the norms
    _forward_kernel[grid](q, k, f, A_log.float().contiguous(), dt_bias.float().contiguous(), qn, kn, q_rstd, k_rstd,
                          g, cu_seqlens, chunk_indices, 0.0 if lower_bound is None else lower_bound, L2_EPS, T, NT, sq,
                          sk, sf, H=H, K=K, BT=CHUNK, IS_VARLEN=cu_seqlens is not None,
                          USE_LOWER_BOUND=lower_bound is not None, NORMS=norms is not None,
                          num_warps=_warps(K, warps))
    return g


def kda_gate_norm_backward(dq: torch.Tensor, dk: torch.Tensor, dg: torch.Tensor, qn: torch.Tensor,
                           q_rstd: torch.Tensor, kn: torch.Tensor, k_rstd: torch.Tensor, f: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor, *, lower_bound: float | None,
                           cu_seqlens: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None,
                           warps: int | None = None) -> tuple[torch.Tensor, ...]:
    """kda_gate_norm_backward_reference on the kernel: (dq_in, dk_in in qn's dtype, df in f's, dA_log, ddt_bias
    fp32 in their parameters' shapes). dq, dk, dg: fp32, contiguous (fla's intra stage's outputs). warps: the
    launch's (None: 8 for K <= 128, else 16)."""
    _require_triton("kda_gate_norm_backward")
    validate(qn, kn, f, A_log, dt_bias, cu_seqlens)
    for name, t in dict(dq=dq, dk=dk, dg=dg, qn=qn, kn=kn, q_rstd=q_rstd, k_rstd=k_rstd).items():
        if not t.is_contiguous():
            raise ValueError(f"kda_gate_norm_backward: {name} is not contiguous (strides {t.stride()}); call "
                             ".contiguous()")
    if any(t.dtype != torch.float32 for t in (dq, dk, dg, q_rstd, k_rstd)):
        raise ValueError("kda_gate_norm_backward: dq, dk, dg, q_rstd and k_rstd must be fp32 on the kernel (fp64 "
                         "runs on the specification)")
    dq_in, dk_in = torch.empty_like(qn), torch.empty_like(kn)
    return (dq_in, dk_in, *_launch_backward(dg, f, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices,
                                            (dq, dk, qn, kn, q_rstd, k_rstd, dq_in, dk_in), warps))


def kda_gate_backward(dg: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                      lower_bound: float | None, cu_seqlens: torch.Tensor | None = None,
                      chunk_indices: torch.Tensor | None = None, warps: int | None = None) -> tuple[torch.Tensor, ...]:
    """kda_gate_norm_backward's gate part alone (the same kernel, its norms switched off, its programs split over
    column blocks): (df in f's dtype, dA_log, ddt_bias), for a route whose intra-chunk kernel applied the norms'
    backward (moontrain.model.kda.intra_norm_kernel). dg: fp32, contiguous. warps: the launch's (None:
    GATE_WARPS)."""
    _require_triton("kda_gate_backward")
    validate(f, f, f, A_log, dt_bias, cu_seqlens)
    if not dg.is_contiguous() or dg.dtype != torch.float32:
        raise ValueError(f"kda_gate_backward: dg must be fp32 and contiguous, got {dg.dtype} with strides "
                         f"{dg.stride()}")
    return _launch_backward(dg, f, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, None, warps)


def _launch_backward(dg: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     lower_bound: float | None, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                     norms: tuple[torch.Tensor, ...] | None, warps: int | None) -> tuple[torch.Tensor, ...]:
    B, T, H, K = dg.shape
    f, sf = _token_strided(f)
    chunk_indices, NT, grid = _grid(B, T, H, cu_seqlens, chunk_indices)
    # the gate alone is per column: its programs take GATE_BLOCK columns each (with the norms, whole rows)
    BK = K if norms is not None else min(K, GATE_BLOCK)
    split = K // BK
    df = torch.empty(B, T, H, K, dtype=f.dtype, device=f.device)
    dA_part = torch.empty(grid[0] * split * B, H, dtype=torch.float32, device=f.device)
    dbias_part = torch.empty(grid[0] * B, H * K, dtype=torch.float32, device=f.device)
    dq, dk, qn, kn, q_rstd, k_rstd, dq_in, dk_in = norms if norms is not None else (dg,) * 8  # unread without
    _backward_kernel[(grid[0] * split, grid[1])](
        dq, dk, dg, qn, kn, q_rstd, k_rstd, f, A_log.float().contiguous(), dt_bias.float().contiguous(), dq_in, dk_in,
        df, dA_part, dbias_part, cu_seqlens, chunk_indices, 0.0 if lower_bound is None else lower_bound, T, NT, sf,
        H=H, K=K, BK=BK, BT=CHUNK, IS_VARLEN=cu_seqlens is not None, USE_LOWER_BOUND=lower_bound is not None,
        NORMS=norms is not None, num_warps=_warps(K, GATE_WARPS if warps is None and norms is None else warps))
    return (df, dA_part.sum(0).view_as(A_log).to(A_log.dtype), dbias_part.sum(0).view_as(dt_bias).to(dt_bias.dtype))
