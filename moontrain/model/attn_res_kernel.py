"""Triton kernels of one AttnRes aggregation, forward and backward (moontrain.model.attn_res's
depth_forward / depth_backward are the specification; kernels.attn_res picks these).

Legend: N values, M rows (batch x sequence), D hidden, BM rows per program; q = query * key_weight in fp32, which
the kernels form from the two parameters they read in place (no launches of their own for it).

    r_n = rsqrt(mean_D(v_n^2) + eps)   logit_n = (v_n . q) r_n   p = softmax_n(logit)   h = sum_n p_n v_n
    backward, per row (gh = dL/dh):  gp_n = gh . v_n   s_n = v_n . q   gl_n = p_n (gp_n - sum_m p_m gp_m)
    dv_n = gh p_n + (gl_n r_n) q - (gl_n s_n r_n^3 / D) v_n          dq = sum_rows sum_n (gl_n r_n) v_n

One program per BM rows holds the row statistics of all N values ([N, BM] fp32 tiles) and walks D twice: the
forward once for each value's two row sums, once for the weighted sum (h accumulated in fp32 in ascending n,
as the specification sums, rounded once to the values' dtype); the backward once for the two dot products of
every value, once for the value gradients and dq. A program's rows of the N values (BM x D x N elements) are
read from HBM in the first walk and mostly from L2 in the second, where the compiled specification reads
every value three times and gh twice per value in separate reductions. dq is deterministic: the backward runs at most
BWD_PROGRAMS programs (BWD_PROGRAMS_MANY from BWD_MANY_N values), each walking its row blocks in turn and summing
its fp32 [D] partial in its own row of a [programs, D] buffer; one small kernel sums the rows in a fixed order
and forms both parameters' gradients (no atomics, and no [M / BM, D] buffer or separate sum, products and casts).
A completed block's gradient is the sum over the aggregations that read it (attn_res.BlockGrad): for such a
value the backward loads the sum so far and stores the sum (SUM_INTO, a compile-time bit per value), where
autograd would store the gradient and add it in another kernel (one read and one write of it against four).

Values arrive as separate tensors (the completed blocks and the partial sum, never stacked: stacking is a
copy of all of them): the kernels take MAX_VALUES pointer arguments, the unused ones None, and pick the n-th
with a compile-time branch, so every pointer keeps Triton's alignment specialisation. N above MAX_VALUES
is refused here; moontrain.model.attn_res.triton_math runs the specification for it.

Numerics against the specification: the same formulas in fp32; the row sums of D products are summed in
another order (tiles of BLOCK_D), so r, the logits, p and everything after them differ in the last bits;
tests/moontrain/model/test_attn_res_kernel_interpreted.py holds them to the bound it derives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_VALUES = 16
# rows, columns and warps per program: one row of 2048 columns, 4 warps, the fastest forward and backward at
# N = 2..4 of 8 tiles x 3 program counts that benchmarks/bench_attn_res.py timed, device alone, at k3_small's shape
# on an H100 (docs/performance.md); the warm-up manifest's entries of the two kernels (recipes/data/
# triton_kernels_sm90.json) carry BM and BD: a new tile makes them stale, compiled for nothing
BLOCK_M, BLOCK_D = 1, 2048
FWD_WARPS, BWD_WARPS = 4, 4
# the backward's programs from BWD_MANY_N values up: with N = 4 values summed into their block gradients (the step's
# call) the backward takes 138 registers (ptxas), 3 programs an SM, so BWD_PROGRAMS would run in two waves; 3 x
# 132 SMs (H100, H200) run in one (413 against 554 us at N 4 on an H100, docs/performance.md)
BWD_MANY_N, BWD_PROGRAMS_MANY = 4, 396
# backward programs at most: each walks its row blocks in turn and keeps one dq partial, so the partials are few
# (and as many on every GPU: dq sums in the same order everywhere); _param_grad_kernel's tile over them
BWD_PROGRAMS = 512
PARAM_PARTS, PARAM_COLS = 64, 64


@triton.jit
def _pick(n: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """The n-th pointer (n a compile-time constant: the other branches are never built)."""
    p = v0
    if n == 1:
        p = v1
    if n == 2:
        p = v2
    if n == 3:
        p = v3
    if n == 4:
        p = v4
    if n == 5:
        p = v5
    if n == 6:
        p = v6
    if n == 7:
        p = v7
    if n == 8:
        p = v8
    if n == 9:
        p = v9
    if n == 10:
        p = v10
    if n == 11:
        p = v11
    if n == 12:
        p = v12
    if n == 13:
        p = v13
    if n == 14:
        p = v14
    if n == 15:
        p = v15
    return p


@triton.jit
def _row_of(tile, n_idx, n: tl.constexpr):
    """Row n of an [N_P, BM] tile, as a [BM] vector."""
    return tl.sum(tl.where(n_idx[:, None] == n, tile, 0.0), axis=0)


@triton.jit
def _query(qry_ptr, kw_ptr, cols, col_ok):
    """The effective query q = query * key_weight in fp32 over `cols`: the pseudo-query times the keys' RMSNorm
    weight, each widened exactly, the product rounded once (torch's fp32 product, bitwise)."""
    a = tl.load(qry_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return a * tl.load(kw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _fwd_kernel(h_ptr, r_ptr, p_ptr, qry_ptr, kw_ptr, M, eps,
                v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
                D: tl.constexpr, N: tl.constexpr, N_P: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    base = rows.to(tl.int64)[:, None] * D
    n_idx = tl.arange(0, N_P)
    logit_t = tl.full((N_P, BM), float("-inf"), tl.float32)
    r_t = tl.zeros((N_P, BM), tl.float32)
    for n in tl.static_range(N):
        v_ptr = _pick(n, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
        ss = tl.zeros((BM,), tl.float32)
        dot = tl.zeros((BM,), tl.float32)
        for d0 in tl.range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            col_ok = cols < D
            v = tl.load(v_ptr + base + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            q = _query(qry_ptr, kw_ptr, cols, col_ok)
            ss += tl.sum(v * v, axis=1)
            dot += tl.sum(v * q[None, :], axis=1)
        r = 1.0 / tl.sqrt(ss / D + eps)
        logit_t = tl.where(n_idx[:, None] == n, (dot * r)[None, :], logit_t)
        r_t = tl.where(n_idx[:, None] == n, r[None, :], r_t)
    e = tl.exp(logit_t - tl.max(logit_t, axis=0)[None, :])  # rows n >= N: exp(-inf) = 0
    p_t = e / tl.sum(e, axis=0)[None, :]
    stat_ok = (n_idx[:, None] < N) & row_ok[None, :]
    tl.store(r_ptr + n_idx[:, None] * M + rows[None, :], r_t, mask=stat_ok)
    tl.store(p_ptr + n_idx[:, None] * M + rows[None, :], p_t, mask=stat_ok)
    for d0 in tl.range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        mask = row_ok[:, None] & (cols < D)[None, :]
        h = tl.zeros((BM, BD), tl.float32)
        for n in tl.static_range(N):
            v_ptr = _pick(n, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
            v = tl.load(v_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h += _row_of(p_t, n_idx, n)[:, None] * v
        tl.store(h_ptr + base + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile(gh_ptr, qry_ptr, kw_ptr, base, row_ok, d0, D: tl.constexpr, BD: tl.constexpr):
    """A backward walk's column tile at d0: its columns, their mask, the rows' mask, gh's tile in fp32 and q."""
    cols = d0 + tl.arange(0, BD)
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    gh = tl.load(gh_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return cols, col_ok, mask, gh, _query(qry_ptr, kw_ptr, cols, col_ok)


@triton.jit
def _bwd_kernel(gh_ptr, r_ptr, p_ptr, qry_ptr, kw_ptr, gq_ptr, M,
                v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
                g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11, g12, g13, g14, g15,
                D: tl.constexpr, N: tl.constexpr, N_P: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                SUM_INTO: tl.constexpr):
    pid = tl.program_id(0)
    n_idx = tl.arange(0, N_P)
    for blk in tl.range(pid, tl.cdiv(M, BM), tl.num_programs(0)):  # this program's row blocks, in turn
        rows = blk * BM + tl.arange(0, BM)
        row_ok = rows < M
        base = rows.to(tl.int64)[:, None] * D
        stat_ok = (n_idx[:, None] < N) & row_ok[None, :]
        p_t = tl.load(p_ptr + n_idx[:, None] * M + rows[None, :], mask=stat_ok, other=0.0)
        r_t = tl.load(r_ptr + n_idx[:, None] * M + rows[None, :], mask=stat_ok, other=0.0)
        gp_t = tl.zeros((N_P, BM), tl.float32)
        s_t = tl.zeros((N_P, BM), tl.float32)
        for d0 in tl.range(0, D, BD):
            cols, col_ok, mask, gh, q = _bwd_tile(gh_ptr, qry_ptr, kw_ptr, base, row_ok, d0, D, BD)
            for n in tl.static_range(N):
                v_ptr = _pick(n, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
                v = tl.load(v_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                gp_t += tl.where(n_idx[:, None] == n, tl.sum(gh * v, axis=1)[None, :], 0.0)
                s_t += tl.where(n_idx[:, None] == n, tl.sum(v * q[None, :], axis=1)[None, :], 0.0)
        gl_t = p_t * (gp_t - tl.sum(p_t * gp_t, axis=0)[None, :])
        b_t = gl_t * r_t
        c_t = gl_t * s_t * (r_t * r_t * r_t) / D
        for d0 in tl.range(0, D, BD):
            cols, col_ok, mask, gh, q = _bwd_tile(gh_ptr, qry_ptr, kw_ptr, base, row_ok, d0, D, BD)
            gq = tl.zeros((BD,), tl.float32)
            for n in tl.static_range(N):
                v_ptr = _pick(n, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
                g_ptr = _pick(n, g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11, g12, g13, g14, g15)
                v = tl.load(v_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                b = _row_of(b_t, n_idx, n)[:, None]
                gv = gh * _row_of(p_t, n_idx, n)[:, None] + b * q[None, :] - _row_of(c_t, n_idx, n)[:, None] * v
                if (SUM_INTO >> n) & 1:  # value n's gradient is added to the sum its g pointer holds
                    gv += tl.load(g_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(g_ptr + base + cols[None, :], gv.to(g_ptr.dtype.element_ty), mask=mask)
                gq += tl.sum(b * v, axis=0)
            # the program's dq partial: its first block stores, the later ones add (no zeroed buffer needed)
            part = gq_ptr + pid.to(tl.int64) * D + cols
            tl.debug_barrier()  # the previous block's store of it, by whichever thread, is visible
            gq += tl.load(part, mask=col_ok & (blk > pid), other=0.0)
            tl.store(part, gq, mask=col_ok)


@triton.jit
def _param_grad_kernel(parts_ptr, qry_ptr, kw_ptr, gq_out_ptr, gw_out_ptr, P, D: tl.constexpr, BP: tl.constexpr,
                       BC: tl.constexpr):
    """dq = the backward programs' partials summed (in a fixed order), then the two parameters' gradients by the
    product rule in fp32 (a bf16 parameter widens exactly), each rounded once to its parameter's dtype."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    col_ok = cols < D
    acc = tl.zeros((BP, BC), tl.float32)
    for p0 in tl.range(0, P, BP):
        parts = p0 + tl.arange(0, BP)
        acc += tl.load(parts_ptr + parts.to(tl.int64)[:, None] * D + cols[None, :],
                       mask=(parts < P)[:, None] & col_ok[None, :], other=0.0)
    gq = tl.sum(acc, axis=0)
    q = tl.load(qry_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(gq_out_ptr + cols, (gq * kw).to(gq_out_ptr.dtype.element_ty), mask=col_ok)
    tl.store(gw_out_ptr + cols, (gq * q).to(gw_out_ptr.dtype.element_ty), mask=col_ok)


def _check(values: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], int]:
    """The values as contiguous tensors of one shape and dtype, and D."""
    if not 1 <= len(values) <= MAX_VALUES:
        raise ValueError(f"the AttnRes kernels take 1 to {MAX_VALUES} values, got {len(values)}; more run the "
                         "PyTorch math (moontrain.model.attn_res.triton_math does)")
    first = values[0]
    for v in values[1:]:
        if v.shape != first.shape or v.dtype != first.dtype or v.device != first.device:
            raise ValueError(f"AttnRes values must share shape, dtype and device: {tuple(first.shape)} "
                             f"{first.dtype} {first.device} against {tuple(v.shape)} {v.dtype} {v.device}")
    return tuple(v.contiguous() for v in values), first.shape[-1]


def _check_params(query: torch.Tensor, key_weight: torch.Tensor, D: int) -> None:
    """The kernels read the pseudo-query and the key-norm weight in place: contiguous [D] float tensors."""
    for name, t in (("query", query), ("key_weight", key_weight)):
        if t.shape != (D,) or not t.is_contiguous() or not t.is_floating_point():
            raise ValueError(f"the AttnRes kernels take a contiguous float {name} of [{D}], got {tuple(t.shape)} "
                             f"{t.dtype} contiguous={t.is_contiguous()}")


def _block_d(D: int) -> int:
    return min(BLOCK_D, triton.next_power_of_2(D))


def _slots(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [*tensors, *([None] * (MAX_VALUES - len(tensors)))]


def depth_forward(query: torch.Tensor, key_weight: torch.Tensor, eps: float, values: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attn_res.depth_forward in the forward kernel: (h in the values' dtype, r [N, ...], p [N, ...])."""
    values, D = _check(values)
    N, M = len(values), values[0].numel() // D
    _check_params(query, key_weight, D)
    h = torch.empty_like(values[0])
    r = torch.empty(N, *values[0].shape[:-1], dtype=torch.float32, device=h.device)
    p = torch.empty_like(r)
    _fwd_kernel[(triton.cdiv(M, BLOCK_M),)](h, r, p, query, key_weight, M, float(eps), *_slots(values), D=D, N=N,
                                           N_P=triton.next_power_of_2(N), BM=BLOCK_M, BD=_block_d(D),
                                           num_warps=FWD_WARPS)
    return h, r, p


def depth_backward(query: torch.Tensor, key_weight: torch.Tensor, r_NBT: torch.Tensor, p_NBT: torch.Tensor,
                   grad_h: torch.Tensor, values: tuple[torch.Tensor, ...],
                   into: list[torch.Tensor | None] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """attn_res.depth_backward in the backward kernel: (grad of the query, of the key-norm weight, of every
    value), the parameters' grads through the product rule in fp32, rounded once to their dtype. into: per
    value None or a gradient summed so far (contiguous, the value's shape and dtype), to which the kernel adds
    the value's gradient in fp32 before its one rounding, in place; that tensor is then the value's entry."""
    values, D = _check(values)
    N, M = len(values), values[0].numel() // D
    into = into if into is not None else [None] * N
    for v, t in zip(values, into, strict=True):
        if t is not None and (t.shape != v.shape or t.dtype != v.dtype or not t.is_contiguous()):
            raise ValueError(f"an AttnRes gradient sum must be contiguous with its value's shape and dtype: "
                             f"{tuple(t.shape)} {t.dtype} against {tuple(v.shape)} {v.dtype}")
    _check_params(query, key_weight, D)
    grads = [torch.empty_like(v) if t is None else t for v, t in zip(values, into, strict=True)]
    sum_into = sum(1 << n for n, t in enumerate(into) if t is not None)
    programs = min(triton.cdiv(M, BLOCK_M), BWD_PROGRAMS if N < BWD_MANY_N else BWD_PROGRAMS_MANY)
    gq_parts = torch.empty(programs, D, dtype=torch.float32, device=query.device)
    if programs:
        _bwd_kernel[(programs,)](grad_h.contiguous(), r_NBT.contiguous(), p_NBT.contiguous(), query, key_weight,
                                 gq_parts, M, *_slots(values), *_slots(grads), D=D, N=N,
                                 N_P=triton.next_power_of_2(N), BM=BLOCK_M, BD=_block_d(D), SUM_INTO=sum_into,
                                 num_warps=BWD_WARPS)
    grad_query, grad_key_weight = torch.empty_like(query), torch.empty_like(key_weight)
    _param_grad_kernel[(triton.cdiv(D, PARAM_COLS),)](gq_parts, query, key_weight, grad_query, grad_key_weight,
                                                      programs, D=D, BP=PARAM_PARTS, BC=PARAM_COLS)
    return grad_query, grad_key_weight, grads
