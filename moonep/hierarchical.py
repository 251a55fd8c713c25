"""Hierarchical expert parallelism: one EP group of N hosts x G ranks, tokens crossing hosts through
torch.distributed (NCCL; gloo on the CPU) and moonep balancing each host's share inside the host
(docs/scale.md, "The hierarchical layout").

Layout: EP rank h * G + g is rank g of host h. Host h owns the expert block [h E/N, (h+1) E/N) and its
rank g the experts [(h G + g) epn, (h G + g + 1) epn), epn = E / (N G): the same experts as EP rank
h G + g of a one-level group. Two process groups: the host group (the G ranks of a host: one moonep
Buffer in entries mode and its symmetric heap) and the rail group (the N ranks with the same g, one per
host: the network all-to-alls). `host_groups` builds both.

One call of `hierarchical_expert_glu`, forward:
1. route: which remote hosts each token visits (the hosts of its K experts); the row counts go through an
   all-to-all of [N] ints over the rail group and are read on the host (torch.distributed's
   all_to_all_single takes its splits as host integers: one device-to-host sync per call).
2. host dispatch: each token row goes once to every remote host it visits, to the rank with the same g,
   in (host, token) order, with its K global expert ids and K route weights. The host stage of rank
   (h, g) is n = N s rows: its own s tokens, the received rows in ascending source host, then zero
   padding; a row's entries are its experts on host h (renumbered inside the block), -1 elsewhere.
3. host-local experts: moonep.expert_glu on the host Buffer (entries mode, max_tokens N S): every rank of
   the host receives exactly its share of the host's entries, static shapes. A row's entries on this
   host are summed in fp32 in ascending k and rounded to the Buffer's dtype (the partial sum).
4. host combine: the partial rows go back along the reverse all-to-all (in the Buffer's dtype); the
   source sums a token's partials in fp32 in ascending host order, starting from zero, and rounds once.
Backward is the adjoint: the host combine's backward is a host dispatch of grad_y, moonep's backward runs
inside the host (expert weight grads stay with their owners, reduce_grad inside the host), and the host
dispatch's backward sends each row's grad back and sums it in fp32 in ascending host order. Route
weights travel as whole rows; entries of other hosts are absent in the host stage, so their grads are
zero there and each weight's grad comes from its expert's host alone.

Summation order: y[t] = round(sum over hosts h ascending of round(sum over k ascending of t's entries
on h)), every sum in fp32. For a token whose experts lie on one host this is the one-level combine's
result bit for bit; otherwise it is the one-level group run once per host with the other hosts' entries
absent, the partials summed in host order (tests/moonep/test_hierarchical.py); grad_x likewise. With
the host Buffer's combine_reduce="destination" each partial is itself a sum of per-rank partials (one
more rounding each: the last bf16 bit may differ from the one-level result).

Memory: the host stage takes the worst case, n = N s rows per rank (docs/scale.md: why that does not scale).

Legend: s tokens of this rank, K top-k, H hidden, N hosts, G ranks per host, E experts of the group,
n = N s host-stage rows, m rows this rank sends to remote hosts, r rows it receives.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from moonep.buffer import Buffer
from moonep.config import BufferConfig
from moonep.moe import expert_glu
from moonep.pools import ExpertPools, LayerExperts


def host_groups(ep_groups: list[list[int]], ranks_per_host: int
                ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Collective over the world: the host groups and rail groups of every EP group -> (host group, rail
    group) of this rank (None, None when it is in no EP group).

    Each `ep_groups` entry lists one EP group's global ranks in EP-rank order; its ranks
    [h G, (h + 1) G) form host h (G = ranks_per_host), and ranks h G + g over h form rail g."""
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
    hosts, rails = [], []
    for ranks in ep_groups:
        if len(ranks) % ranks_per_host:
            raise ValueError(f"an EP group of {len(ranks)} ranks does not split into hosts of {ranks_per_host} "
                             f"ranks; choose ranks_per_host among the divisors of {len(ranks)}")
        num_hosts = len(ranks) // ranks_per_host
        hosts += [ranks[h * ranks_per_host:(h + 1) * ranks_per_host] for h in range(num_hosts)]
        rails += [ranks[g::ranks_per_host] for g in range(ranks_per_host)]
    host, _ = dist.new_subgroups_by_enumeration(hosts)
    rail, _ = dist.new_subgroups_by_enumeration(rails)
    return host, rail


class HostRoute(NamedTuple):
    """One call's network traffic (identical in forward and backward, so saved with the call)."""

    num_tokens: int  # s
    token_m: torch.Tensor  # int64 [m] token of each row sent to a remote host, in (host, token) order
    send_splits: list[int]  # [N] rows to each host (0 to this host)
    recv_splits: list[int]  # [N] rows from each host (0 from this host)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)


class HierarchicalBuffer:
    """The host Buffer (moonep, entries mode) of one rank of a hierarchical EP group, and its rail group.

    `config` describes the whole EP group as a one-level BufferConfig would (max_tokens S per rank,
    num_experts E of the group); the host Buffer is derived from it: E / N experts, max_tokens N S,
    entries mode. Collective over the EP group."""

    def __init__(self, config: BufferConfig, host_group: dist.ProcessGroup, rail_group: dist.ProcessGroup,
                 device: torch.device | str | None = None) -> None:
        if config.entries:
            raise ValueError("HierarchicalBuffer takes the EP group's one-level BufferConfig (entries=False); its "
                             "host Buffer runs in entries mode by construction")
        self.config = config
        self.rail_group = rail_group
        self.num_hosts = dist.get_world_size(rail_group)
        self.ranks_per_host = dist.get_world_size(host_group)
        self.host_idx = dist.get_rank(rail_group)
        self.local_rank = dist.get_rank(host_group)
        N, G, E = self.num_hosts, self.ranks_per_host, config.num_experts
        if E % (N * G):
            raise ValueError(f"num_experts={E} is not divisible by the EP group's {N} hosts x {G} ranks = {N * G}; "
                             f"use a multiple of {N * G} experts")
        self.experts_per_host = E // N
        host_config = dataclasses.replace(config, max_tokens=N * config.max_tokens, num_experts=E // N, entries=True)
        self.host = Buffer(host_config, host_group, device)
        self.device = self.host.device
        self._check_groups(host_group)

    def _check_groups(self, host_group: dist.ProcessGroup) -> None:
        """Every rank of the host group is on the same host index, every rank of the rail group has the same
        local rank: otherwise the expert blocks and the all-to-alls would not meet."""
        mine = torch.tensor([self.host_idx, self.local_rank], dtype=torch.int64, device=self.device)
        for group, col, what in ((host_group, 0, "host index (rank in its rail group)"),
                                 (self.rail_group, 1, "local rank (rank in its host group)")):
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, mine, group=group)
            values = [int(t[col]) for t in every]
            if len(set(values)) != 1:
                raise ValueError(f"hierarchical EP groups do not form a grid: the ranks of one group have the {what} "
                                 f"{values}; build the groups with moonep.hierarchical.host_groups")

    @property
    def ep_rank(self) -> int:
        """This rank's index in the EP group: its local experts are those of one-level EP rank ep_rank."""
        return self.host_idx * self.ranks_per_host + self.local_rank

    @property
    def num_ranks(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def make_pools(self, projections: dict[str, tuple[int, int]], dtype: torch.dtype | None = None) -> ExpertPools:
        """ExpertPools over the host Buffer: this rank's epn experts and its slots (copies inside the host)."""
        return ExpertPools(self.host, projections, dtype)

    # ------------------------------------------------------------------ the network stage
    def route(self, topk_sK: torch.Tensor) -> HostRoute:
        """Which rows go to which remote host (collective over the rail group; reads the counts on the host)."""
        s = topk_sK.shape[0]
        N, h = self.num_hosts, self.host_idx
        visit_sN = torch.zeros(s, N, dtype=torch.bool, device=topk_sK.device)
        visit_sN.scatter_(1, topk_sK.long() // self.experts_per_host, True)
        visit_sN[:, h] = False
        _, token_m = torch.nonzero(visit_sN.t(), as_tuple=True)  # (host, token) order
        send_N = visit_sN.sum(0)
        recv_N = torch.empty_like(send_N)
        if N > 1:
            dist.all_to_all_single(recv_N, send_N, group=self.rail_group)
        else:
            recv_N.zero_()
        send_splits, recv_splits = torch.stack([send_N, recv_N]).tolist()
        return HostRoute(s, token_m, send_splits, recv_splits)

    def to_hosts(self, route: HostRoute, rows_sX: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[n, X]: rows_sX, then the rows received from the remote hosts (ascending host), then `fill`."""
        s, r = route.num_tokens, route.num_recv
        out = rows_sX.new_full((self.num_hosts * s, rows_sX.shape[1]), fill)
        out[:s] = rows_sX
        if self.num_hosts > 1:
            send = rows_sX.index_select(0, route.token_m)
            dist.all_to_all_single(_wire(out[s:s + r]), _wire(send), route.recv_splits, route.send_splits,
                                   group=self.rail_group)
        return out

    def from_hosts(self, route: HostRoute, rows_nX: torch.Tensor) -> torch.Tensor:
        """[s, X] in rows_nX's dtype: each token's partial rows (its own host's at [0, s), the remote hosts'
        sent back along the reverse all-to-all) summed in fp32 in ascending host order, rounded once."""
        s, r = route.num_tokens, route.num_recv
        acc = torch.zeros(s, rows_nX.shape[1], dtype=torch.float32, device=rows_nX.device)
        if self.num_hosts == 1:
            return acc.add_(rows_nX[:s].float()).to(rows_nX.dtype)
        back = rows_nX.new_empty(route.token_m.numel(), rows_nX.shape[1])
        dist.all_to_all_single(_wire(back), _wire(rows_nX[s:s + r].contiguous()), route.send_splits,
                               route.recv_splits, group=self.rail_group)
        lo = 0
        for host, num in enumerate(route.send_splits):
            if host == self.host_idx:
                acc.add_(rows_nX[:s].float())
            elif num:  # each token at most once per host: every element gets one exact fp32 add
                acc.index_add_(0, route.token_m[lo:lo + num], back[lo:lo + num].float())
            lo += num
        return acc.to(rows_nX.dtype)

    def host_topk(self, route: HostRoute, topk_sK: torch.Tensor) -> torch.Tensor:
        """int32 [n, K]: the host stage's entries, ids inside this host's block, -1 for the other hosts'
        experts and on padding rows."""
        ids_nK = self.to_hosts(route, topk_sK.to(torch.int32), fill=-1)
        local = ids_nK - self.host_idx * self.experts_per_host
        mine = (ids_nK >= 0) & (local >= 0) & (local < self.experts_per_host)
        return torch.where(mine, local, -1).contiguous()

    def destroy(self) -> None:
        self.host.destroy()

    def __enter__(self) -> HierarchicalBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as uint8 rows: the all-to-alls move bits, never reduce (gloo has no bf16 or int16)."""
    return t.view(torch.uint8)


class _ToHosts(torch.autograd.Function):
    """Host dispatch of rows; its backward is the host combine (fp32, ascending host order)."""

    @staticmethod
    def forward(ctx, rows_sX: torch.Tensor, hbuf: HierarchicalBuffer, route: HostRoute) -> torch.Tensor:
        ctx.hbuf, ctx.route = hbuf, route
        return hbuf.to_hosts(route, rows_sX)

    @staticmethod
    def backward(ctx, grad_nX: torch.Tensor):
        return ctx.hbuf.from_hosts(ctx.route, grad_nX.contiguous()), None, None


class _FromHosts(torch.autograd.Function):
    """Host combine of partial rows; its backward is the host dispatch of the grads."""

    @staticmethod
    def forward(ctx, rows_nX: torch.Tensor, hbuf: HierarchicalBuffer, route: HostRoute) -> torch.Tensor:
        ctx.hbuf, ctx.route = hbuf, route
        return hbuf.from_hosts(route, rows_nX)

    @staticmethod
    def backward(ctx, grad_sX: torch.Tensor):
        return ctx.hbuf.to_hosts(ctx.route, grad_sX.contiguous()), None, None


def hierarchical_expert_glu(hbuf: HierarchicalBuffer, pools: ExpertPools, layer: LayerExperts, x_sH: torch.Tensor,
                            weights_sK: torch.Tensor, topk_sK: torch.Tensor, *, activation: str = "swiglu"
                            ) -> torch.Tensor:
    """moonep.expert_glu over a hierarchical EP group: y[t] = sum_k w[t,k] * expert_{topk[t,k]}(x[t]), the
    sum in the order of the module docstring. topk_sK holds global expert ids of the group; `pools` come
    from hbuf.make_pools. Differentiable in x_sH and weights_sK; collective over the EP group (every rank
    calls it with the same s)."""
    if pools.buffer is not hbuf.host:
        raise ValueError("pools do not belong to this HierarchicalBuffer; build them with hbuf.make_pools")
    cfg = hbuf.config
    s = x_sH.shape[0] if x_sH.dim() == 2 else -1
    if not 1 <= s <= cfg.max_tokens:
        raise ValueError(f"this call has s={s} tokens, but the hierarchical buffer was built with max_tokens "
                         f"S={cfg.max_tokens}; pass 1 <= s <= S tokens")
    if tuple(topk_sK.shape) != (s, cfg.topk) or topk_sK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_sK must be int32/int64 of shape {(s, cfg.topk)}, got {topk_sK.dtype} "
                         f"{tuple(topk_sK.shape)}")
    if tuple(weights_sK.shape) != (s, cfg.topk):
        raise ValueError(f"weights_sK must have shape {(s, cfg.topk)}, got {tuple(weights_sK.shape)}")
    _check_ids(hbuf, topk_sK)
    route = hbuf.route(topk_sK)
    topk_nK = hbuf.host_topk(route, topk_sK)
    x_nH = _ToHosts.apply(x_sH.contiguous(), hbuf, route)
    w_nK = _ToHosts.apply(weights_sK.contiguous(), hbuf, route)
    y_nH = expert_glu(hbuf.host, pools, layer, x_nH, w_nK, topk_nK, activation=activation)
    return _FromHosts.apply(y_nH, hbuf, route)


def _check_ids(hbuf: HierarchicalBuffer, topk_sK: torch.Tensor) -> None:
    """With value checks on (the host Buffer's check_values): expert ids in [0, E), agreed over the whole EP
    group (rail, then host) before anything moves, so one rank's bad routing makes every rank raise."""
    if not hbuf.host.check_values:
        return
    E = hbuf.config.num_experts
    bad = topk_sK.numel() > 0 and (int(topk_sK.min()) < 0 or int(topk_sK.max()) >= E)
    flag = torch.tensor([int(bad)], dtype=torch.int32, device=hbuf.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=hbuf.rail_group)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=hbuf.host.group)
    if bad:
        raise ValueError(f"topk_sK holds expert ids outside [0, {E}) (min {int(topk_sK.min())}, max "
                         f"{int(topk_sK.max())}); route to the EP group's experts")
    if flag.item():
        raise ValueError("hierarchical_expert_glu: another rank of the EP group rejected its routing (its error says "
                         "why); nothing was sent on any rank")
