"""One hierarchical-EP problem run three ways on the same ranks (shared by tests/moonep/test_hierarchical.py on
gloo and tests/moonep/test_hierarchical_multigpu.py on 2 GPUs):

- `hier`: moonep.hierarchical over N hosts of R / N ranks;
- `plain`: one moonep Buffer over all R ranks (the one-level layer);
- `per_host`: the one-level group once per host, the other hosts' entries absent (entries mode).

Every Buffer runs the PyTorch data path (BufferOptions.kernels='torch'), the specification the Triton path
is tested against. `check_rank` makes the bitwise statements of one rank's results. They assume that a row's
expert output and route-weight grad do not depend on which other rows share the GEMM or the reduction (the
host stage and the one-level calls group rows differently): true of the CPU kernels at these small widths,
not at every width (at H=512, F=2048 the CPU GEMM moved one route-weight grad of 256 by one fp32 rounding).

Legend: R ranks, N hosts, E experts, H hidden, F expert FFN width, K top-k, S tokens per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, expert_glu, glu_projections
from moonep.hierarchical import HierarchicalBuffer, hierarchical_expert_glu, host_groups
from moonep.routing import generate_routing
from tests.moonep.helpers.moe_reference import merged


@dataclass(frozen=True)
class Case:
    R: int
    N: int
    E: int = 16
    H: int = 32
    F: int = 64
    K: int = 4
    S: int = 24

    @property
    def epn(self) -> int:
        return self.E // self.R

    def config(self, entries: bool = False) -> BufferConfig:
        return BufferConfig(max_tokens=self.S, hidden=self.H, topk=self.K, num_experts=self.E, token_padding=4,
                            entries=entries, options=BufferOptions(kernels="torch"))


def problem(c: Case):
    """x, expert weights, routing (skewed; every third token on one host's experts only), route weights, grad_y."""
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(c.R, c.S, c.H, generator=g).to(torch.bfloat16)
    w = {"gate": torch.randn(c.E, c.H, c.F, generator=g) / c.H**0.5,
         "up": torch.randn(c.E, c.H, c.F, generator=g) / c.H**0.5,
         "down": torch.randn(c.E, c.F, c.H, generator=g) / c.F**0.5}
    w = merged({k: v.to(torch.bfloat16) for k, v in w.items()})
    topk = generate_routing(num_ranks=c.R, tokens_per_rank=c.S, num_experts=c.E, topk=c.K, target_maxvio=1.5,
                            seed=11).topk_RsK.clone()
    per_host = c.E // c.N
    for r in range(c.R):
        for t in range(0, c.S, 3):
            h = (t // 3 + r) % c.N
            topk[r, t] = h * per_host + torch.randperm(per_host, generator=g)[:c.K]
    weights = torch.rand(c.R, c.S, c.K, generator=g)
    grad_y = torch.randn(c.R, c.S, c.H, generator=g).to(torch.bfloat16)
    return x, w, topk.to(torch.int32), weights, grad_y


def _run(call, x_sH, w_sK, grad_y_sH, device) -> tuple[torch.Tensor, ...]:
    x = x_sH.to(device, copy=True).requires_grad_()
    wt = w_sK.to(device, copy=True).requires_grad_()
    y = call(x, wt)
    (y.double() * grad_y_sH.to(device).double()).sum().backward()
    return tuple(t.to("cpu", copy=True) for t in (y.detach(), x.grad, wt.grad))


def _layer(pools: ExpertPools, w: dict[str, torch.Tensor], ep_rank: int, epn: int):
    layer = pools.add_layer()
    for p in w:
        layer.w_local[p].copy_(w[p][ep_rank * epn:(ep_rank + 1) * epn])
    return layer


def run_case(rank: int, c: Case, device: torch.device) -> dict:
    """Collective over the world (R ranks): the three runs of this rank, results on the CPU."""
    x, w, topk, weights, grad_y = problem(c)
    topk_sK = topk[rank].to(device)
    args = (x[rank], weights[rank], grad_y[rank], device)
    proj = glu_projections(c.H, c.F)
    host, rail = host_groups([list(range(c.R))], c.R // c.N)
    out: dict = {}
    with HierarchicalBuffer(c.config(), host, rail, device) as hbuf:
        assert hbuf.ep_rank == rank and hbuf.host.num_ranks == c.R // c.N
        pools = hbuf.make_pools(proj)
        layer = _layer(pools, w, hbuf.ep_rank, c.epn)
        out["hier"] = _run(lambda a, b: hierarchical_expert_glu(hbuf, pools, layer, a, b, topk_sK), *args)
        hbuf.host.wait_pending()
        out["hier_g"] = {p: layer.g_local[p].to("cpu", copy=True) for p in w}
        out["host_slots"] = int((pools.slot_plan.slot_expert_RB >= 0).sum())
    with Buffer(c.config(), dist.group.WORLD, device) as buf:
        pools = ExpertPools(buf, proj)
        layer = _layer(pools, w, rank, c.epn)
        out["plain"] = _run(lambda a, b: expert_glu(buf, pools, layer, a, b, topk_sK), *args)
        buf.wait_pending()
        out["plain_g"] = {p: layer.g_local[p].to("cpu", copy=True) for p in w}
    with Buffer(c.config(entries=True), dist.group.WORLD, device) as buf:
        pools = ExpertPools(buf, proj)
        layer = _layer(pools, w, rank, c.epn)
        host_of = topk_sK // (c.E // c.N)
        out["per_host"] = [
            _run(lambda a, b, h=h: expert_glu(buf, pools, layer, a, b, torch.where(host_of == h, topk_sK, -1)),
                 *args)
            for h in range(c.N)]
        buf.wait_pending()
    return out


def hosts_per_token(c: Case, topk_RsK: torch.Tensor) -> torch.Tensor:
    """[R, S]: how many hosts hold one of the token's experts."""
    return torch.stack([(topk_RsK // (c.E // c.N) == h).any(-1) for h in range(c.N)]).sum(0)


def _bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == want.dtype and torch.equal(got, want):
        return
    bad = torch.nonzero(got != want)
    first = tuple(bad[0].tolist()) if len(bad) else ()
    raise AssertionError(f"{name}: dtypes {got.dtype}/{want.dtype}, {len(bad)} elements differ"
                         + (f", first at {list(first)}: {got[first]} vs {want[first]}" if first else ""))


def check_rank(c: Case, rank: int, out: dict) -> None:
    """The bitwise statements (tests/moonep/test_hierarchical.py's docstring) for one rank's results."""
    _, _, topk, _, _ = problem(c)
    y, gx, gw = out["hier"]
    y_plain, gx_plain, gw_plain = out["plain"]
    one = hosts_per_token(c, topk)[rank] == 1
    _bitwise(f"rank {rank} y (one-host tokens) vs one level", y[one], y_plain[one])
    _bitwise(f"rank {rank} grad x (one-host tokens) vs one level", gx[one], gx_plain[one])
    _bitwise(f"rank {rank} grad route weights vs one level", gw, gw_plain)
    partials = out["per_host"]  # summed in fp32 in ascending host order from zero, rounded once
    y_ref = sum((p[0].float() for p in partials), torch.zeros(c.S, c.H)).to(torch.bfloat16)
    gx_ref = sum((p[1].float() for p in partials), torch.zeros(c.S, c.H)).to(torch.bfloat16)
    gw_ref = sum((p[2] for p in partials), torch.zeros(c.S, c.K))
    _bitwise(f"rank {rank} y vs one level per host in host order", y, y_ref)
    _bitwise(f"rank {rank} grad x vs one level per host in host order", gx, gx_ref)
    _bitwise(f"rank {rank} grad route weights vs one level per host", gw, gw_ref)
