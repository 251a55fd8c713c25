"""The chunked KDA (moontrain.model.kda.ops) against a token-by-token recurrence written here, in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moontrain.model.kda.ops import chunk_kda_reference


def recurrent_kda(q, k, v, g, beta, scale, doc_start=None):
    """One token at a time: decay the state per key channel, apply the delta rule, read it with q."""
    B, T, H, K = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=v.dtype)
    for b in range(B):
        for h in range(H):
            state = torch.zeros(K, v.shape[-1], dtype=v.dtype)
            for t in range(T):
                if doc_start is not None and doc_start[b, t]:
                    state = torch.zeros_like(state)
                state = torch.exp(g[b, t, h])[:, None] * state
                kt, vt = k[b, t, h], v[b, t, h]
                state = state + beta[b, t, h] * torch.outer(kt, vt - state.T @ kt)
                out[b, t, h] = state.T @ (scale * q[b, t, h])
    return out


def make_inputs(B, T, H, K, V, seed, lower=-5.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = lower * torch.rand(B, T, H, K, generator=gen, dtype=dtype) ** 3  # mostly slow, some fast decays
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("T,chunk", [(37, 8), (64, 16), (20, 64)])
def test_chunked_matches_recurrence(T, chunk):
    q, k, v, g, beta = make_inputs(2, T, 3, 8, 6, seed=T)
    want = recurrent_kda(q, k, v, g, beta, scale=8 ** -0.5)
    got = chunk_kda_reference(q, k, v, g, beta, scale=8 ** -0.5, chunk_size=chunk)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_document_starts_reset_the_state():
    T = 45
    q, k, v, g, beta = make_inputs(2, T, 2, 8, 4, seed=7)
    doc_start = torch.zeros(2, T, dtype=torch.bool)
    doc_start[0, [5, 6, 16, 17, 30]] = True  # one-token documents, a start on a chunk edge (16)
    doc_start[1, 40] = True
    want = recurrent_kda(q, k, v, g, beta, 0.3, doc_start)
    got = chunk_kda_reference(q, k, v, g, beta, scale=0.3, doc_start_BT=doc_start, chunk_size=8)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_strong_decay_stays_finite_in_fp32():
    """64 tokens at the gate's lower bound decay by e^-320 (beyond fp32): outputs and gradients finite and
    equal to the fp64 recurrence."""
    q, k, v, g, beta = make_inputs(1, 70, 2, 8, 4, seed=3)
    g = torch.full_like(g, -5.0)
    want = recurrent_kda(q, k, v, g, beta, 0.35)
    args = [x.float().requires_grad_() for x in (q, k, v, g, beta)]
    got = chunk_kda_reference(*args, scale=0.35, chunk_size=64)
    got.square().sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert all(torch.isfinite(a.grad).all() for a in args)


def test_gradients_match_recurrence():
    q, k, v, g, beta = make_inputs(1, 19, 2, 4, 3, seed=11)
    doc_start = torch.zeros(1, 19, dtype=torch.bool)
    doc_start[0, 9] = True
    w = torch.randn(1, 19, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = []
    for fn in (lambda *a: recurrent_kda(*a, 0.5, doc_start),
               lambda *a: chunk_kda_reference(*a, scale=0.5, doc_start_BT=doc_start, chunk_size=4)):
        args = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        (fn(*args) * w).sum().backward()
        grads.append([a.grad for a in args])
    for want, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
