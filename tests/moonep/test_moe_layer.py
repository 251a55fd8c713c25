"""A whole MoE layer on moonep at R ranks equals the single-process dense reference.

Tolerance: derived, not guessed. The dense reference is computed twice, in bf16 (the precision
moonep runs at) and in fp64; moonep must be within 2x the bf16 reference's own error to fp64
(plus a floor of 2 bf16 ulps of the largest value for values that the bf16 reference happens
to hit exactly).
"""

from __future__ import annotations

import pytest
import torch

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, expert_glu, glu_projections
from moonep.routing import generate_routing
from tests.dist_utils import run_ranks
from tests.moonep.helpers.moe_reference import merged, reference_grads
from tests.moonep.helpers.two_layer_case import check_two_layers, run_two_layers

H, F, K, S = 32, 64, 4, 24
BF16_EPS = 2.0**-8


def _problem(R: int, E: int, maxvio: float, H: int = H, F: int = F, K: int = K, S: int = S):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(R, S, H, generator=g).to(torch.bfloat16)
    w = {"gate": torch.randn(E, H, F, generator=g) / H**0.5, "up": torch.randn(E, H, F, generator=g) / H**0.5,
         "down": torch.randn(E, F, H, generator=g) / F**0.5}
    w = merged({k: v.to(torch.bfloat16) for k, v in w.items()})
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio, seed=7)
    weights = torch.rand(R, S, K, generator=g)
    grad_y = torch.randn(R, S, H, generator=g).to(torch.bfloat16)
    return x, w, routing.topk_RsK, weights, grad_y


def _rank_fn(rank: int, world: int, E: int, maxvio: float, activation: str = "swiglu",
             options: BufferOptions | None = None) -> dict:
    x, w, topk, weights, grad_y = _problem(world, E, maxvio)
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4,
                              options=options or BufferOptions()))
    try:
        pools = ExpertPools(buf, glu_projections(H, F))
        layer = pools.add_layer()
        epn = E // world
        for p in w:
            layer.w_local[p].copy_(w[p][rank * epn:(rank + 1) * epn])
        x_sH = x[rank].clone().requires_grad_()
        w_sK = weights[rank].clone().requires_grad_()
        y = expert_glu(buf, pools, layer, x_sH, w_sK, topk[rank], activation=activation)
        (y.double() * grad_y[rank].double()).sum().backward()
        buf.wait_pending()  # reduce_grad is left queued (synchronous on the CPU)
        plan = pools.slot_plan
        return {
            "y": y.detach(), "gx": x_sH.grad, "gw": w_sK.grad,
            "g_local": {p: layer.g_local[p].clone() for p in w},
            "slots_used": int((plan.slot_expert_RB >= 0).sum()),
            "reduce_pool_zero": all(bool((pools.g_slots_all[p][rank] == 0).all()) for p in w),
        }
    finally:
        buf.destroy()


def _close(name: str, got: torch.Tensor, ref16: torch.Tensor, ref64: torch.Tensor) -> None:
    err_ref = (ref16.double() - ref64).abs().max().item()
    floor = 2 * BF16_EPS * ref64.abs().max().item()
    tol = 2 * err_ref + floor
    err = (got.double() - ref64).abs().max().item()
    assert err <= tol, f"{name}: max error {err:.3e} to fp64 exceeds {tol:.3e} (bf16 reference error {err_ref:.3e})"


@pytest.mark.parametrize(("R", "activation"), [(1, "swiglu"), (2, "swiglu"), (4, "swiglu"), (2, "situ_glu")])
def test_moe_layer_matches_dense_reference(R: int, activation: str) -> None:
    """SiTU-GLU (K3's experts) through the op's activation parameter against the textbook formula."""
    check_against_dense_reference(_rank_fn, R, activation)


@pytest.mark.parametrize("R", [1, 2])
def test_moe_layer_destination_reduce_matches_dense_reference(R: int) -> None:
    """combine_reduce "destination": partial sums per rank, the route weights and the dgrad halves in
    fp32 inside combine (moonep.moe._fused_combine); the same derived tolerance."""
    check_against_dense_reference(_rank_fn, R, "swiglu", BufferOptions(combine_reduce="destination"))


def check_against_dense_reference(rank_fn, R: int, activation: str, *args) -> None:
    """rank_fn(rank, world, E, maxvio, activation, *args) (as _rank_fn) on R ranks against the dense reference."""
    E = 8 if R < 4 else 16
    maxvio = min(2.5, E / K - 1 - 0.1)
    out = run_ranks(rank_fn, R, E, maxvio, activation, *args, timeout_s=240)
    x, w, topk, weights, grad_y = _problem(R, E, maxvio)
    N = R * S
    args = (x.view(N, H), weights.view(N, K), topk.view(N, K), w, grad_y.view(N, H))
    y16, gx16, gw16, gW16 = reference_grads(*args, torch.bfloat16, activation)
    y64, gx64, gw64, gW64 = reference_grads(*args, torch.float64, activation)
    cat = lambda key: torch.cat([o[key] for o in out])
    _close("y", cat("y"), y16, y64)
    _close("grad x", cat("gx"), gx16, gx64)
    _close("grad route weights", cat("gw"), gw16, gw64)
    for p in w:
        _close(f"grad W_{p}", torch.cat([o["g_local"][p] for o in out]), gW16[p], gW64[p])
    if R > 1:
        assert out[0]["slots_used"] > 0, "the skewed routing should need redundant experts"
    assert all(o["reduce_pool_zero"] for o in out), "reduce_grad must leave the consumed slots zero"


def _two_layers(rank: int, world: int, chain: bool) -> dict:
    return run_two_layers(rank, world, None, E=8, H=H, F=F, K=K, S=S, chain=chain)


@pytest.mark.parametrize("chain", [True, False], ids=["early_prefetch", "chain_prefetch_off"])
def test_two_layers_early_prefetch_and_async_reduce_grad_change_no_bit(chain: bool) -> None:
    """Layer 1's backward refills the slots for layer 0 (unless ExpertPools.chain_prefetch is off)
    and leaves reduce_grad queued; the results equal the layers run one at a time, bitwise
    (tests/moonep/helpers/two_layer_case.py)."""
    for out in run_ranks(_two_layers, 2, chain, timeout_s=240):
        check_two_layers(out)


def _one_rank_slots(rank: int, world: int, use_slots: bool) -> dict:
    """Two layers, forward and backward, on one rank; use_slots forces the slot work (prefetch, the
    slot reduction and zeroing) that ExpertPools skips on one rank. Returns the results and the calls
    of the data path's slot operations."""
    E = 8
    x, ws, topks, route, grad_y = _two_layer_inputs(E)
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4))
    try:
        pools = ExpertPools(buf, glu_projections(H, F))
        pools._uses_slots = use_slots
        calls = {"prefetch": 0, "reduce_into_owner": 0, "zero_slots": 0}
        for name in calls:
            setattr(pools._path, name, _counted(calls, name, getattr(pools._path, name)))
        layers = [pools.add_layer(), pools.add_layer()]
        for layer, w in zip(layers, ws, strict=True):
            for p in w:
                layer.w_local[p].copy_(w[p])
        x0 = x.clone().requires_grad_()
        w0, w1 = route[0].clone().requires_grad_(), route[1].clone().requires_grad_()
        y0 = expert_glu(buf, pools, layers[0], x0, w0, topks[0])
        plan0 = pools.slot_plan
        y1 = expert_glu(buf, pools, layers[1], y0, w1, topks[1])
        y1.backward(grad_y)
        buf.wait_pending()
        return {"y": y1.detach(), "gx": x0.grad, "gw0": w0.grad, "gw1": w1.grad, "calls": calls,
                "g": [{p: layer.g_local[p].clone() for p in layer.g_local} for layer in layers],
                "slots_used": [int((p.slot_expert_RB >= 0).sum()) for p in (plan0, pools.slot_plan)]}
    finally:
        buf.destroy()


def _counted(calls: dict[str, int], name: str, fn):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


def _two_layer_inputs(E: int):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    ws = [merged({"gate": (torch.randn(E, H, F, generator=g) / H**0.5).to(torch.bfloat16),
                  "up": (torch.randn(E, H, F, generator=g) / H**0.5).to(torch.bfloat16),
                  "down": (torch.randn(E, F, H, generator=g) / F**0.5).to(torch.bfloat16)}) for _ in range(2)]
    # skewed routings (as skewed as E / K allows): one rank still fills no slot
    topks = [generate_routing(num_ranks=1, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=E / K - 1.1,
                              seed=3 + i).topk_RsK[0] for i in range(2)]
    route = [torch.rand(S, K, generator=g) for _ in range(2)]
    return x, ws, topks, route, torch.randn(S, H, generator=g).to(torch.bfloat16)


def test_one_rank_skips_the_slot_work_and_changes_no_bit() -> None:
    """One rank has no remote expert, so its plans fill no slot: ExpertPools skips prefetch and the
    slot reduction (no data-path call), and every output and gradient equals the run that does them."""
    skipped = run_ranks(_one_rank_slots, 1, False, timeout_s=120)[0]
    full = run_ranks(_one_rank_slots, 1, True, timeout_s=120)[0]
    assert full["slots_used"] == [0, 0] and skipped["slots_used"] == [0, 0], "one rank planned a slot"
    assert skipped["calls"] == {"prefetch": 0, "reduce_into_owner": 0, "zero_slots": 0}, skipped["calls"]
    assert all(n > 0 for n in full["calls"].values()), f"the forced run must do the slot work: {full['calls']}"
    for key in ("y", "gx", "gw0", "gw1"):
        assert torch.equal(skipped[key], full[key]), f"{key} differs when the slot work is skipped"
    for i in range(2):
        for p, g in full["g"][i].items():
            assert torch.equal(skipped["g"][i][p], g), f"grad of layer {i} {p} differs"
            assert bool(g.abs().sum() > 0), f"grad of layer {i} {p} is zero: the test checks nothing"
