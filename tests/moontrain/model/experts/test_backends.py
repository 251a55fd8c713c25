"""Routed experts: the grouped layout (bitwise vs a Python reference), the local backend against a per-token
loop and against the same grouped path with separate W_gate and W_up GEMMs, and the alltoall backend at
EP = 2 and 4 against the local backend under extreme skew.

Math tolerance: both sides are fp32 and compute the same sums in a different order (grouped GEMM vs
per-token matmul, all-to-all vs local); the per-element error is a few fp32 ulps of the accumulated
magnitude, so 1e-5 relative to the largest value (about 100 ulps) bounds it with margin.

Merged gate_up vs separate W_gate, W_up: each column of the merged forward GEMM and of its weight gradient
is the separate GEMM's column, summed over the same terms in the same order (bitwise on CPU fp32 at the
widths here, multiples of the SIMD width); the input gradient sums 2F terms in one GEMM instead of two
sums of F and an add, bounded elementwise by (2F + K + 2) u sum |grad_hu| |W_gate_up| (u = 2^-24; the
terms' absolute values pushed through the same backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moontrain.model.experts import ExpertsContext, ExpertWeights, build_experts_runtime
from moontrain.model.experts.grouped import combine_topk, group_rows, grouped_mm, scatter_rows
from moontrain.model.ffn import glu_activation
from tests.dist_utils import run_ranks

E, H, FF, K, S = 8, 32, 64, 3, 24
RTOL = 1e-5


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    tol = RTOL * ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"


def _ctx(ep: int, group=None) -> ExpertsContext:
    return ExpertsContext(num_experts=E, topk=K, ep_group=group, ep=ep, compute_dtype=torch.float32,
                          token_padding=16, max_tokens=S, device=torch.device("cpu"))


def _weights(ep_rank: int, ep: int) -> ExpertWeights:
    w = ExpertWeights(num_experts=E, ep_rank=ep_rank, ep=ep, hidden=H, intermediate=FF)
    w.init_master(seed=1, layer_idx=0, stds=dict.fromkeys(("gate", "up", "down"), 0.1))
    return w


def _inputs(rank: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x_sH = torch.randn(S, H, generator=gen)
    if skewed:  # every token picks experts 0, 1 and one of 2..3: ranks holding 4..7 receive nothing
        topk_sK = torch.stack([torch.zeros(S), torch.ones(S), 2 + torch.randint(0, 2, (S,), generator=gen)], 1)
    else:
        topk_sK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)])
    weights_sK = torch.rand(S, K, generator=gen)
    return x_sH, weights_sK, topk_sK.long()


def _naive(x_sH, weights_sK, topk_sK, w: dict[str, torch.Tensor]) -> torch.Tensor:
    y = torch.zeros_like(x_sH)
    for t in range(x_sH.shape[0]):
        for k in range(topk_sK.shape[1]):
            e = topk_sK[t, k]
            g, u = (x_sH[t] @ w["gate_up"][e]).split(FF)
            h = F.silu(g) * u
            y[t] = y[t] + weights_sK[t, k] * (h @ w["down"][e])
    return y


def test_group_rows_matches_python_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    expert_n = torch.randint(0, 5, (37,), generator=gen)
    expert_n[expert_n == 3] = 4  # an empty group
    row_n, offs, num_rows = group_rows(expert_n, 5, padding=8)
    start, want_rows, want_offs = 0, [None] * 37, []
    for g in range(5):
        members = [i for i in range(37) if expert_n[i] == g]
        for j, i in enumerate(members):
            want_rows[i] = start + j
        start += -(-len(members) // 8) * 8
        want_offs.append(start)
    assert row_n.tolist() == want_rows
    assert offs.tolist() == want_offs and offs.dtype == torch.int32 and num_rows == want_offs[-1]


def test_local_backend_matches_per_token_loop() -> None:
    w = _weights(0, 1)
    backend = build_experts_runtime("local", _ctx(1)).layer(w)
    x, weights, topk = _inputs(0, skewed=False)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    y = backend.forward(x, weights, topk)
    (y * torch.linspace(-1, 1, H)).sum().backward()
    x_ref, weights_ref = x.detach().clone().requires_grad_(True), weights.detach().clone().requires_grad_(True)
    w_ref = {k: v.detach().clone().requires_grad_(True) for k, v in w.master.items()}
    y_ref = _naive(x_ref, weights_ref, topk, w_ref)
    (y_ref * torch.linspace(-1, 1, H)).sum().backward()
    _close(y, y_ref, "y")
    _close(x.grad, x_ref.grad, "x.grad")
    _close(weights.grad, weights_ref.grad, "weights.grad")
    for name, ref in w_ref.items():
        _close(w.grad[name], ref.grad, f"expert grad {name}")
        assert w.compute[name].grad is None  # folded into the fp32 grad tensor


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got != want).nonzero()
    assert not len(bad), f"{what}: first mismatch at {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_merged_gate_up_matches_separate_gemms(activation: str) -> None:
    """The local backend (one GEMM against gate_up) against the grouped path with W_gate and W_up as separate
    leaves: outputs, route-weight and weight grads bitwise, the input grad within its summation bound."""
    ctx = ExpertsContext(num_experts=E, topk=K, ep_group=None, ep=1, compute_dtype=torch.float32,
                         token_padding=16, max_tokens=S, device=torch.device("cpu"), activation=activation)
    w = _weights(0, 1)
    backend = build_experts_runtime("local", ctx).layer(w)
    x, weights, topk = _inputs(0, skewed=False)
    grad_y = torch.randn(S, H, generator=torch.Generator().manual_seed(9))
    x.requires_grad_(True)
    weights.requires_grad_(True)
    y = backend.forward(x, weights, topk)
    (y * grad_y).sum().backward()

    w_gate, w_up = (t.detach().clone().requires_grad_(True) for t in w.master["gate_up"].split(FF, dim=2))
    w_down = w.master["down"].detach().clone().requires_grad_(True)
    x_ref, weights_ref = x.detach().clone().requires_grad_(True), weights.detach().clone().requires_grad_(True)
    expert_n = topk.reshape(-1)
    row_n, offs_E, num_rows = group_rows(expert_n, E, ctx.token_padding)
    src_n = torch.arange(expert_n.numel()) // K
    x_RH = scatter_rows(x_ref[src_n], row_n, num_rows)
    h_RF, u_RF = grouped_mm(x_RH, w_gate, offs_E), grouped_mm(x_RH, w_up, offs_E)
    h_RF.retain_grad()
    u_RF.retain_grad()
    y_ref = combine_topk(grouped_mm(glu_activation(activation, h_RF, u_RF), w_down, offs_E)[row_n], weights_ref,
                         x.dtype)
    (y_ref * grad_y).sum().backward()

    _assert_equal(y.detach(), y_ref.detach(), "y")
    _assert_equal(weights.grad, weights_ref.grad, "weights.grad")
    _assert_equal(w.grad["gate_up"], torch.cat([w_gate.grad, w_up.grad], dim=2), "gate_up grad")
    _assert_equal(w.grad["down"], w_down.grad, "down grad")
    abs_R2F = torch.cat([h_RF.grad, u_RF.grad], dim=1).abs()
    w_abs = w.master["gate_up"].detach().abs().transpose(1, 2).contiguous()
    abs_RH = grouped_mm(abs_R2F, w_abs, offs_E)
    abs_sH = torch.zeros_like(x).index_add_(0, src_n, abs_RH[row_n])
    bound = (2 * FF + K + 2) * 2.0**-24 * abs_sH
    excess = (x.grad - x_ref.grad).abs() - bound
    assert (excess <= 0).all(), f"x.grad: worst |diff| - bound {excess.max().item():.3g} at {excess.argmax().item()}"


def _alltoall_rank(rank: int, ep: int, skewed: bool) -> dict[str, torch.Tensor]:
    w = _weights(rank, ep)
    backend = build_experts_runtime("alltoall", _ctx(ep, dist.group.WORLD)).layer(w)
    x, weights, topk = _inputs(rank, skewed)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    y = backend.forward(x, weights, topk)
    (y * torch.linspace(-1, 1, H)).sum().backward()
    grads = {}
    for name, g in w.grad.items():
        parts = [torch.empty_like(g) for _ in range(ep)]
        dist.all_gather(parts, g)
        grads[name] = torch.cat(parts)
    return {"y": y.detach(), "x.grad": x.grad, "weights.grad": weights.grad, **grads}


def _check_alltoall(ep: int, skewed: bool) -> None:
    results = run_ranks(_alltoall_rank, ep, skewed, timeout_s=300)
    w = _weights(0, 1)
    backend = build_experts_runtime("local", _ctx(1)).layer(w)
    for rank, got in enumerate(results):
        x, weights, topk = _inputs(rank, skewed)
        x.requires_grad_(True)
        weights.requires_grad_(True)
        y = backend.forward(x, weights, topk)
        (y * torch.linspace(-1, 1, H)).sum().backward()
        _close(got["y"], y.detach(), f"rank {rank} y")
        _close(got["x.grad"], x.grad, f"rank {rank} x.grad")
        _close(got["weights.grad"], weights.grad, f"rank {rank} weights.grad")
    for name, g in w.grad.items():  # grads summed over all ranks' tokens
        _close(results[0][name], g, f"expert grad {name}")


def test_alltoall_matches_local_ep2_uniform() -> None:
    _check_alltoall(2, skewed=False)


def test_alltoall_matches_local_ep4_skewed_with_idle_ranks() -> None:
    _check_alltoall(4, skewed=True)
