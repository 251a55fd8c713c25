"""Hierarchical EP (moonep.hierarchical) on 2 "hosts" x 4 ranks (and 4 x 2: tokens with three and four
partial sums) over gloo equals the one-level result.

World 8 on one machine; each host group builds its own CPU symmetric heap over its 4 ranks, and rows
cross "hosts" through all-to-alls over the rail groups. The same 8 ranks also run the one-level layer
(one moonep Buffer over all 8), with the same expert weights at the same EP ranks:

- bitwise: route-weight grads of every token; y and grad_x of every token whose K experts lie on one
  host; y and grad_x of every token against the one-level group run once per host with the other hosts'
  entries absent (entries mode) and the partials summed in fp32 in ascending host order, which is the
  hierarchical summation order (moonep.hierarchical's docstring);
- weight grads: the same sums of the same bf16 products, but each expert's rows are grouped and split
  over ranks differently, so the fp32 summation order differs: within 2x the bf16 dense reference's own
  error to fp64 (plus 2 bf16 ulps of the largest value), as tests/moonep/test_moe_layer.py.

The routing is skewed (redundant experts inside each host, asserted) and a third of the tokens are forced
onto one host's experts (so both kinds of token are present, asserted).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, ExpertPools, expert_glu, glu_projections
from moonep.hierarchical import HierarchicalBuffer, hierarchical_expert_glu, host_groups
from moonep.routing import generate_routing
from tests.dist_utils import run_ranks
from tests.moonep.moe_reference import reference_grads

R = 8
E, H, F, K, S = 16, 32, 64, 4, 24
EPN = E // R
BF16_EPS = 2.0**-8


def problem(N: int):
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(R, S, H, generator=g).to(torch.bfloat16)
    w = {"gate": torch.randn(E, H, F, generator=g) / H**0.5, "up": torch.randn(E, H, F, generator=g) / H**0.5,
         "down": torch.randn(E, F, H, generator=g) / F**0.5}
    w = {k: v.to(torch.bfloat16) for k, v in w.items()}
    topk = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=1.5,
                            seed=11).topk_RsK.clone()
    one_host = torch.arange(S) % 3 == 0  # these tokens: K distinct experts of host (t // 3) % N only
    for r in range(R):
        for t in torch.nonzero(one_host).flatten().tolist():
            h = (t // 3 + r) % N
            topk[r, t] = h * (E // N) + torch.randperm(E // N, generator=g)[:K]
    weights = torch.rand(R, S, K, generator=g)
    grad_y = torch.randn(R, S, H, generator=g).to(torch.bfloat16)
    return x, w, topk.to(torch.int32), weights, grad_y


def _run(call, x_sH, w_sK, grad_y_sH):
    x = x_sH.clone().requires_grad_()
    wt = w_sK.clone().requires_grad_()
    y = call(x, wt)
    (y.double() * grad_y_sH.double()).sum().backward()
    return y.detach(), x.grad, wt.grad


def _load(layer, w, ep_rank):
    for p in w:
        layer.w_local[p].copy_(w[p][ep_rank * EPN:(ep_rank + 1) * EPN])


def _rank_fn(rank: int, world: int, N: int) -> dict:
    G = R // N
    x, w, topk, weights, grad_y = problem(N)
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4)
    proj = glu_projections(H, F)
    host, rail = host_groups([list(range(R))], G)
    out: dict = {}
    with HierarchicalBuffer(cfg, host, rail) as hbuf:
        assert hbuf.ep_rank == rank and hbuf.host.num_ranks == G
        pools = hbuf.make_pools(proj)
        layer = pools.add_layer()
        _load(layer, w, hbuf.ep_rank)
        out["hier"] = _run(lambda a, b: hierarchical_expert_glu(hbuf, pools, layer, a, b, topk[rank]),
                           x[rank], weights[rank], grad_y[rank])
        hbuf.host.wait_pending()
        out["hier_g"] = {p: layer.g_local[p].clone() for p in w}
        out["host_slots"] = int((pools.slot_plan.slot_expert_RB >= 0).sum())
    with Buffer(cfg, dist.group.WORLD) as buf:  # one level over all 8 ranks
        pools = ExpertPools(buf, proj)
        layer = pools.add_layer()
        _load(layer, w, rank)
        out["plain"] = _run(lambda a, b: expert_glu(buf, pools, layer, a, b, topk[rank]),
                            x[rank], weights[rank], grad_y[rank])
        buf.wait_pending()
        out["plain_g"] = {p: layer.g_local[p].clone() for p in w}
    entries = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4, entries=True)
    with Buffer(entries, dist.group.WORLD) as buf:  # one level, once per host's entries
        pools = ExpertPools(buf, proj)
        layer = pools.add_layer()
        _load(layer, w, rank)
        host_of = topk[rank] // (E // N)
        out["per_host"] = [
            _run(lambda a, b, h=h: expert_glu(buf, pools, layer, a, b, torch.where(host_of == h, topk[rank], -1)),
                 x[rank], weights[rank], grad_y[rank])
            for h in range(N)]
        buf.wait_pending()
    return out


def _first_mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    bad = torch.nonzero(got != want)
    first = tuple(bad[0])
    return f"{name}: {len(bad)} elements differ, first at {list(first)}: {got[first]} vs {want[first]}"


def _bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), _first_mismatch(name, got, want)


def _close(name: str, got: torch.Tensor, ref16: torch.Tensor, ref64: torch.Tensor) -> None:
    err_ref = (ref16.double() - ref64).abs().max().item()
    tol = 2 * err_ref + 2 * BF16_EPS * ref64.abs().max().item()
    err = (got.double() - ref64).abs().max().item()
    assert err <= tol, f"{name}: max error {err:.3e} to fp64 exceeds {tol:.3e} (bf16 reference error {err_ref:.3e})"


@pytest.fixture(scope="module", params=[2, 4], ids=["2x4", "4x2"])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_rank_fn, R, request.param, timeout_s=300)


def test_hierarchical_equals_one_level_bitwise(ranks: tuple[int, list[dict]]) -> None:
    N, ranks = ranks
    x, w, topk, weights, grad_y = problem(N)
    hosts_per_token = torch.stack([(topk // (E // N) == h).any(-1) for h in range(N)]).sum(0)  # [R, S]
    assert (hosts_per_token == 1).any() and (hosts_per_token > 1).any(), "need one-host and multi-host tokens"
    if N > 2:
        assert (hosts_per_token > 2).any(), "need tokens on three or more hosts"
    for r, out in enumerate(ranks):
        y, gx, gw = out["hier"]
        y_plain, gx_plain, gw_plain = out["plain"]
        one = hosts_per_token[r] == 1
        _bitwise(f"rank {r} y (one-host tokens) vs one level", y[one], y_plain[one])
        _bitwise(f"rank {r} grad x (one-host tokens) vs one level", gx[one], gx_plain[one])
        _bitwise(f"rank {r} grad route weights vs one level", gw, gw_plain)
        partials = out["per_host"]
        y_ref = sum((p[0].float() for p in partials), torch.zeros(S, H)).to(torch.bfloat16)
        gx_ref = sum((p[1].float() for p in partials), torch.zeros(S, H)).to(torch.bfloat16)
        gw_ref = sum((p[2] for p in partials), torch.zeros(S, K))
        _bitwise(f"rank {r} y vs one level per host in host order", y, y_ref)
        _bitwise(f"rank {r} grad x vs one level per host in host order", gx, gx_ref)
        _bitwise(f"rank {r} grad route weights vs one level per host", gw, gw_ref)
    assert sum(o["host_slots"] for o in ranks) > 0, "the skewed routing should need redundant experts in a host"


def test_hierarchical_weight_grads_match_reference(ranks: tuple[int, list[dict]]) -> None:
    N, ranks = ranks
    x, w, topk, weights, grad_y = problem(N)
    args = (x.view(R * S, H), weights.view(R * S, K), topk.view(R * S, K), w, grad_y.view(R * S, H))
    _, _, _, gW16 = reference_grads(*args, torch.bfloat16)
    _, _, _, gW64 = reference_grads(*args, torch.float64)
    for p in w:
        for key in ("hier_g", "plain_g"):
            _close(f"{key} W_{p}", torch.cat([o[key][p] for o in ranks]), gW16[p], gW64[p])


def test_host_groups_reject_a_group_that_does_not_split_into_hosts() -> None:
    with pytest.raises(ValueError, match="does not split into hosts of 4 ranks"):
        host_groups([list(range(6))], 4)
    with pytest.raises(ValueError, match="ranks_per_host must be >= 1"):
        host_groups([list(range(4))], 0)
