"""moontrain.model.kda.dqkg (kda_dqkg_reference, the specification of the stage) against autograd, on the CPU in fp64.

The stage's outputs are gradients of the chunked KDA forward with two matrices held fixed: per chunk (g the
chunk-local cumulative log-decay, natural log here; S the state at the chunk's start)
    A = (I + Lm)^-1        w = A (beta k e^g)      u = A (beta v)      v_new = u - w S
    o = (scale q e^g) S + Aqk v_new                S' = e^gn S + (k e^(gn - g))^T v_new
with Lm (the strictly lower matrix A inverts) and Aqk leaves. For loss = <do, o> + <dht, S_last>, autograd's
gradients of q, k, v, beta, g and Lm are the stage's dq, dk, dv2, db, dg (before fla's reverse cumsum; in
fla's log2 units g / ln 2 is the input) and dA, given h = S, dh = dL/dS' and dv = dL/dv_new, which autograd
also supplies (retain_grad). Lm and Aqk take their KDA values, and the forward's o is checked against
moontrain.model.kda.ops.chunk_kda_reference first, so these are gradients of KDA itself.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moontrain.model.kda.dqkg import CHUNK, kda_dqkg_reference, prepare_chunk_indices
from moontrain.model.kda.dqkg import STAGE_OUTPUTS as OUTPUTS
from moontrain.model.kda.ops import chunk_kda_reference

CU_SEQLENS = [0, 100, 130, 150, 290]  # 2 chunks (the second partial), 1, 1 and 3 (the last of 2 tokens)


def kda_chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, beta: torch.Tensor,
                        Lm: torch.Tensor, Aqk: torch.Tensor, seqs: list[tuple[int, int, int]], scale: float,
                        dht: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """(o, loss, per listed chunk {S, S_next, v_new, A}) of the module docstring's forward over the
    sequences (batch row, first token, end) in chunk-list order; Lm, Aqk [B, T, H, C] in fla's layout."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=v.dtype)
    chunks = []
    loss = 0.0
    for n, (b, bos, eos) in enumerate(seqs):
        S = torch.zeros(H, K, v.shape[-1], dtype=v.dtype)
        for t0 in range(bos, eos, CHUNK):
            t1 = min(t0 + CHUNK, eos)
            L = t1 - t0
            qc, kc, vc, Gc = (x[b, t0:t1].transpose(0, 1) for x in (q, k, v, G))  # [H, L, X]
            bc = beta[b, t0:t1].transpose(0, 1).unsqueeze(-1)
            eye = torch.eye(L, dtype=v.dtype)
            Ac = torch.linalg.solve_triangular(eye + Lm[b, t0:t1, :, :L].transpose(0, 1).tril(-1), eye, upper=False)
            kg = kc * Gc.exp()
            v_new = Ac @ (vc * bc) - (Ac @ (kg * bc)) @ S
            v_new.retain_grad()
            o[b, t0:t1] = ((qc * scale * Gc.exp()) @ S + Aqk[b, t0:t1, :, :L].transpose(0, 1).tril() @ v_new
                           ).transpose(0, 1)
            Gn = Gc[:, -1:]
            S_next = Gn.exp().transpose(-1, -2) * S + (kc * (Gn - Gc).exp()).transpose(-1, -2) @ v_new
            S_next.retain_grad()
            chunks.append(dict(S=S, S_next=S_next, v_new=v_new, A=Ac, b=b, t0=t0, t1=t1))
            S = S_next
        loss = loss + (S * dht[n]).sum()
    return o, loss + (o * do).sum(), chunks


def chunk_local_cumsum(g_raw: torch.Tensor, seqs: list[tuple[int, int, int]]) -> torch.Tensor:
    """The gate's cumulative sum within each chunk, chunks counted from each sequence's start (fla's varlen
    chunks): g_raw [B, T, H, K] -> G of the same shape."""
    G = torch.zeros_like(g_raw)
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, CHUNK):
            G[b, t0:min(t0 + CHUNK, eos)] = g_raw[b, t0:min(t0 + CHUNK, eos)].cumsum(0)
    return G


def kda_matrices(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, beta: torch.Tensor,
                 seqs: list[tuple[int, int, int]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's Lm_rj = beta_r sum_c k_rc k_jc e^(G_rc - G_jc) (j < r) and Aqk_rj = scale sum_c q_rc k_jc
    e^(G_rc - G_jc) (j <= r) per chunk, in fla's [B, T, H, C] layout."""
    Lm = torch.zeros(*q.shape[:3], CHUNK, dtype=q.dtype)
    Aqk = torch.zeros_like(Lm)
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, CHUNK):
            t1 = min(t0 + CHUNK, eos)
            qc, kc, Gc = (x[b, t0:t1].transpose(0, 1) for x in (q, k, G))
            D = torch.exp((Gc.unsqueeze(-2) - Gc.unsqueeze(-3)).clamp(max=0))  # [H, r, j, K]; r >= j: <= 0
            L = t1 - t0
            Lm[b, t0:t1, :, :L] = (torch.einsum("hrc,hjc,hrjc->hrj", kc, kc, D).tril(-1)
                                   * beta[b, t0:t1].transpose(0, 1).unsqueeze(-1)).transpose(0, 1)
            Aqk[b, t0:t1, :, :L] = (scale * torch.einsum("hrc,hjc,hrjc->hrj", qc, kc, D).tril()).transpose(0, 1)
    return Lm, Aqk


@pytest.mark.parametrize("case", ["batch", "docs", "docs_graph"])
def test_reference_is_the_kda_gradient(case: str) -> None:
    """kda_dqkg_reference(fp64) == autograd's gradients (module docstring) to fp64 rounding (1e-10 of each
    output's largest value; the two compute the same sums in different orders)."""

    torch.manual_seed(0)
    H, K, V = 2, 64, 32  # K != V: a mix-up of the two fails
    if case == "batch":
        B, T = 2, 160  # chunks of 64, 64, 32 per row
        seqs = [(b, 0, T) for b in range(B)]
        cu_seqlens = chunk_indices = doc_start = None
    else:
        B, T = 1, CU_SEQLENS[-1]
        seqs = [(0, a, e) for a, e in itertools.pairwise(CU_SEQLENS)]
        cu_seqlens = torch.tensor(CU_SEQLENS)
        chunk_indices = prepare_chunk_indices(cu_seqlens)
        doc_start = torch.zeros(B, T, dtype=torch.bool)
        doc_start[0, CU_SEQLENS[1:-1]] = True
    f64 = torch.float64
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=f64), dim=-1)
    v = torch.randn(B, T, H, V, dtype=f64)
    beta = torch.rand(B, T, H, dtype=f64)
    g_raw = -torch.rand(B, T, H, K, dtype=f64) * 0.5
    G = chunk_local_cumsum(g_raw, seqs)
    scale = K ** -0.5
    Lm, Aqk = kda_matrices(q, k, G, beta, seqs, scale)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, G, beta, Lm, Aqk)]
    do = torch.randn(B, T, H, V, dtype=f64)
    dht = torch.randn(len(seqs), H, K, V, dtype=f64)
    o, loss, chunks = kda_chunked_forward(*leaves, seqs, scale, dht, do)
    ref_o = chunk_kda_reference(q, k, v, g_raw, beta, scale=scale, doc_start_BT=doc_start)
    assert (o.detach() - ref_o).abs().max() <= 1e-10 * ref_o.abs().max(), "the forward is not KDA's"
    loss.backward()

    v_new, dv = torch.zeros_like(v), torch.zeros_like(v)
    A = torch.zeros_like(Lm)
    for c in chunks:
        b, t0, t1 = c["b"], c["t0"], c["t1"]
        v_new[b, t0:t1] = c["v_new"].detach().transpose(0, 1)
        dv[b, t0:t1] = c["v_new"].grad.transpose(0, 1)
        A[b, t0:t1, :, :t1 - t0] = c["A"].detach().transpose(0, 1)
    h = torch.stack([c["S"].detach() for c in chunks]).view(B if cu_seqlens is None else 1, -1, H, K, V)
    dh = torch.stack([c["S_next"].grad for c in chunks]).view(h.shape)
    if case == "docs_graph":  # fla's use_graph chunk list: padding rows (sequence -1) with states to ignore
        chunk_indices = torch.cat([chunk_indices, torch.tensor([[-1, 0], [-1, 0]])])
        h = torch.cat([h, torch.full((1, 2, H, K, V), float("nan"), dtype=f64)], 1)
        dh = torch.cat([dh, torch.full((1, 2, H, K, V), float("nan"), dtype=f64)], 1)
    got = kda_dqkg_reference(q=q, k=k, v=v, v_new=v_new, g=G / math.log(2), beta=beta, A=A, h=h, do=do, dh=dh,
                             dv=dv, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                             use_graph=case == "docs_graph")
    want = [leaf.grad for leaf in (leaves[0], leaves[1], leaves[2], leaves[4], leaves[3], leaves[5])]
    for name, x, y in zip(OUTPUTS, got, want, strict=True):
        assert x.dtype == f64 and x.shape == y.shape, name
        err = (x - y).abs().max().item()
        assert err <= 1e-10 * y.abs().max().item(), f"{name}: max |diff| {err:.2e}, max |grad| {y.abs().max():.2e}"
