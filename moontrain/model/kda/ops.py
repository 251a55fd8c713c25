"""Chunked Kimi Delta Attention (KDA) in pure PyTorch: the specification the fla kernel is tested against.

Legend: B batch, T sequence, H heads, K key head dim, V value head dim, N chunks, L chunk length.

The recurrence, per head, with a per-channel decay a_t = exp(g_t) (g_t <= 0, shape K) and a scalar
write strength beta_t in (0, 1):
    S~_t = diag(a_t) S_{t-1}                               (decay, S is K x V)
    S_t  = S~_t + beta_t k_t (v_t - S~_t^T k_t)^T          (delta rule: replace what k_t reads)
    o_t  = S_t^T (scale q_t)
with q and k L2-normalised by the caller. A document boundary resets the state: the first token of a
document sees S_{t-1} = 0 (a_t = 0), so nothing flows across an end-of-document.

Chunked form (L tokens per chunk, state S_0 at the chunk's start). With Gc_r = g_1 + ... + g_r (the
chunk's cumulative log-decay) and D_rj = exp(Gc_r - Gc_j) (decay from token j to token r, j <= r):
    S_r = diag(exp(Gc_r)) S_0 + sum_{j<=r} diag(D_rj) k_j u_j^T
where the pseudo-values u_j = beta_j (v_j - S~_j^T k_j) solve a unit lower-triangular system:
    (I + A) U = diag(beta) V - diag(beta) (K * exp(Gc)) S_0,   A_rj = beta_r sum_c k_rc k_jc D_rjc (j < r)
so U = U~ - W S_0 with U~ = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta) (K * exp(Gc)) (both
independent of S_0, computed for all chunks at once). Then, chunk after chunk:
    O   = (Q * exp(Gc)) S_0 + P U,                         P_rj = sum_c q_rc k_jc D_rjc (j <= r)
    S_L = diag(exp(Gc_L)) S_0 + (K * exp(Gc_L - Gc))^T U.
Document boundaries enter as masks, not as a -inf decay (and Gc restarts at each document start, so
a token's output is bitwise independent of earlier documents): a decay product over (j, r] is zero when a
document starts inside it, i.e. when the chunk-local count of document starts differs between r and j;
the decay from the chunk's start is zero once a document has started in the chunk. Every exponent that
survives the masks is <= 0, so nothing overflows whatever the gate's range.

Memory: the pairwise decays are B*H*T*L*K values (fp32), so this is the CPU/CI path and the reference
at moderate sizes; on CUDA the layer runs fla's chunk_kda (Triton), tested against this function.
The layer calls kda(): the gate (decay from the raw forget projection), the L2 normalisation of q and k,
then the chunked recurrence; kda_fla() is the same contract on fla's fused kernels (gate, norm and
recurrence in Triton, document boundaries as cu_seqlens over the flattened batch).

Rejected: a factored exp(Gc_r) * exp(-Gc_j) form (overflows in fp32 once a chunk's decay passes e^-88,
e.g. 18 tokens at the lower bound -5); a -inf gate at document starts (NaN gradients through exp(-inf -
(-inf))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moontrain.model.documents import flat_sequence_bounds
from moontrain.model.kda.chunk_lists import share_with_fla
from moontrain.model.kda.gate_norm import L2_EPS, at_least_fp32, kda_gate

CHUNK = 64  # tokens per chunk (fla's default; its kernels take 32 or 64)


def chunk_kda_reference(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTHK: torch.Tensor,
                        beta_BTH: torch.Tensor, *, scale: float, doc_start_BT: torch.Tensor | None = None,
                        chunk_size: int = CHUNK) -> torch.Tensor:
    """KDA output o_BTHV (in v's dtype). q/k: L2-normalised; g: log-decay (<= 0); beta in (0, 1);
    doc_start_BT: True at the first token of each document after the first (the state resets there).
    Computes in fp32 (fp64 if v is fp64); differentiable through autograd."""
    return chunk_kda_with_state(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=scale, doc_start_BT=doc_start_BT,
                                chunk_size=chunk_size)[0]


def chunk_kda_with_state(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTHK: torch.Tensor,
                         beta_BTH: torch.Tensor, *, scale: float, doc_start_BT: torch.Tensor | None = None,
                         initial_state_BHKV: torch.Tensor | None = None, chunk_size: int = CHUNK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_kda_reference continuing from a state (decoding): (o_BTHV, the state after the last token,
    fp32 [B, H, K, V]). The initial state is that of the tokens before; a document start drops it."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    L = chunk_size
    dtype = torch.float64 if v_BTHV.dtype == torch.float64 else torch.float32
    pad = (-T) % L  # trailing zeros (beta = 0 writes nothing) change no earlier output: causal
    N = (T + pad) // L

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, L, ...]
        x = x.to(dtype)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(B, N, L, *x.shape[2:])
        return x.movedim(3, 1)

    q = chunks(q_BTHK) * scale
    k, v, g = chunks(k_BTHK), chunks(v_BTHV), chunks(g_BTHK)
    beta = chunks(beta_BTH.unsqueeze(-1))  # [B, H, N, L, 1]
    if doc_start_BT is None:
        starts_BNL = torch.zeros(B, N, L, dtype=torch.long, device=q.device)
    else:
        starts_BNL = F.pad(doc_start_BT.long(), (0, pad)).view(B, N, L)
    docs = starts_BNL.cumsum(-1).unsqueeze(1)  # [B, 1, N, L]: document starts so far in the chunk
    idx = torch.arange(L, device=q.device)
    same = (docs.unsqueeze(-1) == docs.unsqueeze(-2)) & (idx[:, None] >= idx[None, :])  # [B, 1, N, L, L]
    alive = (docs == 0).unsqueeze(-1)  # [B, 1, N, L, 1]: no document started since the chunk's start

    # the cumulative log-decay restarts at each document start: a sum over the token's own document (a
    # 0/1 matmul), so an earlier document's gates do not even enter the rounding of a later one's
    Gc = same.to(dtype) @ g  # [B, H, N, L, K]
    diff = Gc.unsqueeze(-2) - Gc.unsqueeze(-3)  # [B, H, N, L(r), L(j), K]
    decay = torch.exp(torch.where(same.unsqueeze(-1), diff, float("-inf")))
    P = torch.einsum("bhnrc,bhnjc,bhnrjc->bhnrj", q, k, decay)
    A = torch.einsum("bhnrc,bhnjc,bhnrjc->bhnrj", k, k, decay).tril(-1) * beta
    eye = torch.eye(L, dtype=dtype, device=q.device)
    M = eye + A
    Gc_exp = torch.exp(Gc) * alive
    U_tilde = torch.linalg.solve_triangular(M, beta * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(M, beta * k * Gc_exp, upper=False, unitriangular=True)
    same_end = docs == docs[..., -1:]  # [B, 1, N, L]: token j is in the chunk's last document
    k_end = k * torch.exp(torch.where(same_end.unsqueeze(-1), Gc[..., -1:, :] - Gc, float("-inf")))
    decay_end = Gc_exp[..., -1, :].unsqueeze(-1)  # [B, H, N, K, 1]
    q_start = q * Gc_exp

    S = q.new_zeros(B, H, K, V) if initial_state_BHKV is None else initial_state_BHKV.to(dtype)
    outs = []
    for n in range(N):
        U = U_tilde[:, :, n] - W[:, :, n] @ S
        outs.append(q_start[:, :, n] @ S + P[:, :, n] @ U)
        S = decay_end[:, :, n] * S + k_end[:, :, n].transpose(-1, -2) @ U
    o_BHTV = torch.stack(outs, dim=2).reshape(B, H, N * L, V)[:, :, :T]
    return o_BHTV.transpose(1, 2).to(v_BTHV.dtype), S


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    x32 = at_least_fp32(x)
    return x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + L2_EPS)


def kda(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, f_BTHK: torch.Tensor,
        beta_BTH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor, *, lower_bound: float | None,
        scale: float, doc_start_BT: torch.Tensor | None = None,
        seq_bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """KDA from the layer's projections (q/k/v after the short convolution, f the raw forget projection,
    beta after its sigmoid): o_BTHV in v's dtype. The pure-PyTorch path (the specification). seq_bounds
    (the same documents in kda_fla's layout) is not needed here."""
    g = kda_gate(f_BTHK, A_log_H, dt_bias_HK, lower_bound)
    q, k = l2_normalize(q_BTHK), l2_normalize(k_BTHK)
    return chunk_kda_reference(q, k, v_BTHV, g, beta_BTH, scale=scale, doc_start_BT=doc_start_BT)


def kda_fla(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, f_BTHK: torch.Tensor,
            beta_BTH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor, *, lower_bound: float | None,
            scale: float, doc_start_BT: torch.Tensor | None = None,
            seq_bounds: tuple[torch.Tensor, torch.Tensor] | None = None, recompute: bool = True,
            device_chunks: bool = True, gate_norm: bool = False, intra_norm: bool = False,
            walk: bool = False) -> torch.Tensor:
    """kda() on fla-core's chunk_kda (CUDA); recompute: kernels.kda_recompute (fla's disable_recompute negated);
    gate_norm: kernels.kda_gate_norm=moontrain, fla's stages between moontrain's gate-and-norm kernels
    (moontrain.model.kda.chunk) instead of fla's chunk_kda; intra_norm (with gate_norm): kernels.kda_intra=moontrain,
    the intra-chunk stage and the norms' backward in one kernel (moontrain.model.kda.intra_norm_kernel); walk (with
    gate_norm): the forward's state walk and output in one kernel (moontrain.model.kda.walk_kernel), else fla's two.
    With document starts the batch is flattened to one row and every row start and document start opens a
    sequence of cu_seqlens: seq_bounds, the (device, host) pair of moontrain.model.documents.flat_sequence_bounds
    that the forward's DocumentMask carries for all KDA layers, or derived here (one host sync) when not given.
    device_chunks: fla lists the sequences' chunks on the device (its use_graph mode, with max_num_seqs the
    host's exact count), not on the host with a blocking copy per forward: no host sync."""
    from fla.ops.kda import chunk_kda

    B, T = q_BTHK.shape[:2]
    cu_seqlens = cu_seqlens_cpu = None
    graph = {}
    if doc_start_BT is not None:
        cu_seqlens, cu_seqlens_cpu = seq_bounds if seq_bounds is not None else flat_sequence_bounds(doc_start_BT)
        q_BTHK, k_BTHK, v_BTHV, f_BTHK, beta_BTH = (
            x.reshape(1, B * T, *x.shape[2:]) for x in (q_BTHK, k_BTHK, v_BTHV, f_BTHK, beta_BTH))
        if device_chunks:
            graph = {"use_graph": True, "max_num_seqs": cu_seqlens_cpu.numel() - 1}
            share_with_fla()  # the chunk lists made once per forward (moontrain.model.kda.chunk_lists)
    if gate_norm:
        from moontrain.model.kda.chunk import chunk_kda_moontrain

        o = chunk_kda_moontrain(q_BTHK, k_BTHK, v_BTHV, f_BTHK, beta_BTH, A_log_H.float(),
                                dt_bias_HK.float().flatten(), scale=scale, lower_bound=lower_bound,
                                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                max_num_seqs=graph.get("max_num_seqs"), recompute=recompute,
                                intra_norm=intra_norm, walk=walk)
        return o.reshape(B, T, *o.shape[2:])
    if intra_norm:
        raise ValueError("kda_fla: intra_norm (kernels.kda_intra=moontrain) runs inside moontrain's gate-and-norm "
                         "route: pass gate_norm=True (kernels.kda_gate_norm=moontrain)")
    o, _ = chunk_kda(q=q_BTHK, k=k_BTHK, v=v_BTHV, g=f_BTHK, beta=beta_BTH, scale=scale,
                     A_log=A_log_H.float(), dt_bias=dt_bias_HK.float().flatten(),
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     safe_gate=lower_bound is not None, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                     cu_seqlens_cpu=cu_seqlens_cpu, disable_recompute=not recompute, **graph)
    return o.reshape(B, T, *o.shape[2:])


def random_kda_inputs(B: int, T: int, H: int, K: int, *, doc_len: int | None = None, seed: int = 0,
                      device: str = "cuda") -> tuple[list[torch.Tensor], dict, torch.Tensor]:
    """A KDA layer call's inputs at its scales, for the kernel benchmarks and GPU tests: ([q, k, v, f, beta]
    requiring grad (bf16 q/k/v/f N(0, 1), fp32 beta U(0, 1)), the keyword arguments of kda() / kda_fla() (A_log
    = log U(1, 16), dt_bias N(-4, 1), lower bound -5, scale K^-1/2, a document start every doc_len tokens if
    given, with its sequence bounds made once as the forward's DocumentMask carries them: no host sync in a
    call), and the output's grad N(0, 1) in bf16)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen, **bf) for _ in range(4))
    beta = torch.rand(B, T, H, generator=gen, device=device)
    A_log = torch.empty(H, device=device).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(H, K, generator=gen, device=device) - 4
    go = torch.randn(B, T, H, K, generator=gen, **bf)
    doc_start = None
    if doc_len is not None:
        doc_start = torch.zeros(B, T, dtype=torch.bool, device=device)
        doc_start[:, doc_len::doc_len] = True
    kwargs = dict(A_log_H=A_log, dt_bias_HK=dt_bias, lower_bound=-5.0, scale=K ** -0.5, doc_start_BT=doc_start,
                  seq_bounds=flat_sequence_bounds(doc_start) if doc_start is not None else None)
    return [t.requires_grad_() for t in (q, k, v, f, beta)], kwargs, go
