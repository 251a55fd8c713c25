"""KDA's chunked call as moontrain's autograd function (kernels.kda_gate_norm=moontrain): fla-core's stages in
the middle, moontrain's gate-and-norm kernels at the two ends.

Forward: moontrain.model.kda.gate_norm_kernel (q and k L2-normalised, the gate and its chunk-local cumulative
sum: one launch), then fla's intra-chunk forward (Aqk, Akk, w, u, qg, kg), then the state recurrence (h, v_new)
and the output (fla's two kernels, or with walk=True one: moontrain.model.kda.walk_kernel).
Backward: fla's dAv, dhu, dqkg and intra-chunk stages (the last two through fla's dispatch, which
moontrain.model.kda.fla_backend routes to moontrain's kernels per kernels.kda_dqkg / kda_intra), then the
gate-and-norm backward (the reverse cumulative sum, the gate's and the norms' gradients, dA_log and dt_bias's
partial sums: one launch). fla's chunk_kda runs three launches forward and six backward there instead, reads f
through a contiguous copy, and keeps that copy for the backward; here f is read in place. With intra_norm
(kernels.kda_intra=moontrain) the intra-chunk stage is moontrain.model.kda.intra_norm_kernel, which applies the
norms' backward too, and the last launch is the gate's backward alone; there moontrain's dqkg stage, called
directly where fla's dispatch would run it, hands it dq and dk in q's dtype, not fp32 (docs/kda.md: the bytes
saved and the accuracy kept).

The stages are called as fla's chunk_kda calls them (fla-core 0.6.0), for what the model uses: no initial or
final state, H == HV, the state stored [K, V], chunks of 64. The backward reads qn, kn, their reciprocal norms,
v, f, beta and the chunks' two [C, C] matrices; recompute (kernels.kda_recompute) recomputes g, w, u, qg, kg, h
and v_new from them (g by the forward's kernel, bit for bit), otherwise the forward keeps those too (fla's
disable_recompute). Documents: cu_seqlens over the flattened batch
(B = 1); max_num_seqs given lists the chunks on the device (fla's use_graph: no host sync).
"""

from __future__ import annotations

import torch

from moontrain.model.kda.chunk_lists import static_chunk_lists
from moontrain.model.kda.dqkg_kernel import kda_dqkg
from moontrain.model.kda.fla_backend import runs_moontrain_dqkg
from moontrain.model.kda.gate_norm_kernel import (
    kda_gate_backward,
    kda_gate_cumsum,
    kda_gate_norm,
    kda_gate_norm_backward,
)
from moontrain.model.kda.intra_norm import check_lower_bound
from moontrain.model.kda.intra_norm_kernel import kda_intra_norm
from moontrain.model.kda.walk_kernel import kda_forward_walk

CHUNK = 64


class ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, lower_bound: float | None,
                cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, max_num_seqs: int | None,
                recompute: bool, intra_norm: bool, walk: bool) -> torch.Tensor:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

        chunk_indices, chunk_offsets = _chunk_list(q.shape[1], cu_seqlens, cu_seqlens_cpu, max_num_seqs)
        use_graph = cu_seqlens is not None and max_num_seqs is not None
        lists = dict(cu_seqlens=cu_seqlens, chunk_size=CHUNK, chunk_indices=chunk_indices)
        qn, q_rstd, kn, k_rstd, g = kda_gate_norm(q, k, f, A_log, dt_bias, lower_bound=lower_bound,
                                                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        v, beta = v.contiguous(), beta.contiguous()
        # the walk takes qg (q 2^g), which fla's intra forward stores only where the backward keeps it
        w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q=qn, k=kn, v=v, gk=g, beta=beta, scale=scale,
                                                     safe_gate=lower_bound is not None,
                                                     disable_recompute=walk or not recompute, use_graph=use_graph,
                                                     **lists)
        if walk:
            if cu_seqlens is not None and chunk_offsets is None:
                from fla.ops.utils.index import prepare_chunk_offsets

                chunk_offsets = prepare_chunk_offsets(cu_seqlens, CHUNK)
            rows = None if cu_seqlens is None else chunk_indices.shape[0]
            h, v_new, o = kda_forward_walk(kg, w, u, g, qg, Aqk, scale, cu_seqlens=cu_seqlens,
                                           chunk_offsets=chunk_offsets, rows=rows)
        else:
            h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, cu_seqlens_cpu=cu_seqlens_cpu,
                                                       chunk_offsets=chunk_offsets, **lists)
            o = chunk_gla_fwd_o_gk(q=qn, v=v_new, g=g, A=Aqk, h=h, scale=scale, use_graph=use_graph, **lists)
        kept = () if recompute else (g, w, u, qg, kg, v_new, h)
        ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, f, beta, A_log, dt_bias, Aqk, Akk, cu_seqlens,
                              chunk_indices, chunk_offsets, *kept)
        ctx.scale, ctx.lower_bound, ctx.use_graph, ctx.intra_norm = scale, lower_bound, use_graph, intra_norm
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
        from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
        from fla.ops.kda.wy_fast import recompute_w_u_fwd

        (qn, q_rstd, kn, k_rstd, v, f, beta, A_log, dt_bias, Aqk, Akk, cu_seqlens, chunk_indices, chunk_offsets,
         *kept) = ctx.saved_tensors
        scale, lower_bound, use_graph = ctx.scale, ctx.lower_bound, ctx.use_graph
        lists = dict(cu_seqlens=cu_seqlens, chunk_size=CHUNK, chunk_indices=chunk_indices)
        if kept:
            g, w, u, qg, kg, v_new, h = kept
        else:
            g = kda_gate_cumsum(f, A_log, dt_bias, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                                chunk_indices=chunk_indices)
            w, u, qg, kg = recompute_w_u_fwd(k=kn, v=v, beta=beta, A=Akk, gk=g, q=qn, cu_seqlens=cu_seqlens,
                                             chunk_indices=chunk_indices, use_graph=use_graph)
            h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, chunk_offsets=chunk_offsets, **lists)
        do = do.contiguous()
        dAqk, dv = chunk_kda_bwd_dAv(q=qn, k=kn, v=v_new, do=do, A=Aqk, scale=scale, use_graph=use_graph, **lists)
        dh, _, dv = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=g, h0=None, dht=None, do=do, dv=dv,
                                                   scale=scale, chunk_offsets=chunk_offsets, **lists)
        dqkg = dict(q=qn, k=kn, v=v, v_new=v_new, g=g, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=scale,
                    chunk_offsets=chunk_offsets, use_graph=use_graph, **lists)
        if ctx.intra_norm and runs_moontrain_dqkg(**dqkg):  # dq, dk in q's dtype: read once, by intra_norm
            dq, dk, dv, db, dg, dAkk = kda_dqkg(**dqkg, dqk_dtype=qn.dtype)
        else:
            dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(**dqkg)
        if ctx.intra_norm:  # the intra-chunk stage with the norms' backward; the gate's backward after it
            dq, dk, db, dg = kda_intra_norm(qn, kn, g, beta, dAqk, dAkk, dq, dk, db, dg, q_rstd, k_rstd,
                                            lower_bound=lower_bound, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
            df, dA_log, ddt_bias = kda_gate_backward(dg, f, A_log, dt_bias, lower_bound=lower_bound,
                                                     cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        else:
            dq, dk, db, dg = chunk_kda_bwd_intra(q=qn, k=kn, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk,
                                                 db=db, dg=dg, safe_gate=lower_bound is not None, use_graph=use_graph,
                                                 **lists)
            dq, dk, df, dA_log, ddt_bias = kda_gate_norm_backward(dq, dk, dg, qn, q_rstd, kn, k_rstd, f, A_log,
                                                                  dt_bias, lower_bound=lower_bound,
                                                                  cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        return (dq, dk, dv.to(v.dtype), df, db.to(beta.dtype), dA_log, ddt_bias, None, None, None, None, None,
                None, None, None)


def _chunk_list(T: int, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                max_num_seqs: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(chunk_indices, chunk_offsets) as fla's chunk_kda lists the sequences' chunks: on the device with a fixed
    row count where max_num_seqs is given (padding rows of sequence -1), else from the host's bounds."""
    if cu_seqlens is None:
        return None, None
    from fla.ops.utils.index import prepare_chunk_indices

    if max_num_seqs is None:
        return prepare_chunk_indices(cu_seqlens, CHUNK, cu_seqlens_cpu=cu_seqlens_cpu), None
    if cu_seqlens.numel() - 1 != max_num_seqs:
        raise ValueError(f"ChunkKDA: cu_seqlens holds {cu_seqlens.numel() - 1} sequences and max_num_seqs is "
                         f"{max_num_seqs}; pass the host's exact count (cu_seqlens_cpu.numel() - 1)")
    return static_chunk_lists(cu_seqlens, CHUNK, -(-T // CHUNK) + max_num_seqs - 1)


def chunk_kda_moontrain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
                        A_log: torch.Tensor, dt_bias: torch.Tensor, *, scale: float, lower_bound: float | None,
                        cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
                        max_num_seqs: int | None = None, recompute: bool = False,
                        intra_norm: bool = False, walk: bool = False) -> torch.Tensor:
    """o [B, T, H, V] in q's dtype: fla's chunk_kda(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
    safe_gate=lower_bound is not None) on the module docstring's stages. q, k, f may be column slices of the
    projection (token-strided); A_log [H], dt_bias [H * K] fp32. walk: the forward's state walk and output as
    one kernel (moontrain.model.kda.walk_kernel; False: fla's two)."""
    if q.shape[2] != v.shape[2]:
        raise ValueError(f"chunk_kda_moontrain: q has {q.shape[2]} heads and v {v.shape[2]}; grouped value heads "
                         "(GVA) are not supported")
    if intra_norm:  # refused before the forward, not at the backward
        check_lower_bound(lower_bound)
    return ChunkKDA.apply(q, k, v, f, beta, A_log, dt_bias, scale, lower_bound, cu_seqlens, cu_seqlens_cpu,
                          max_num_seqs, recompute, intra_norm, walk)
