"""Triton prefetch / reduce_grad kernels (moonep.kernels.experts) against direct references on GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools
from moonep.routing import generate_routing

pytestmark = pytest.mark.multigpu


def test_prefetch_and_reduce_grad_kernels(group: dist.ProcessGroup) -> None:
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    E, H, F, K, S = 16 * R, 512, 2048, 4, 256  # 512*2048*2 B = 2 MiB per expert row
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E,
                              options=BufferOptions(check_values=False)), group)
    try:
        assert buf.kernel_path == "triton"
        pools = ExpertPools(buf, {"gate": (H, F), "down": (F, H)})
        layer = pools.add_layer()
        g = torch.Generator(device="cuda").manual_seed(rank)
        for p, w in layer.w_local.items():
            w.copy_(torch.randn(w.shape, device="cuda", generator=g).to(w.dtype))
            layer.g_local[p].copy_(torch.randn(layer.g_local[p].shape, device="cuda", generator=g))
        for maxvio in (0.5, 3.0):
            routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio,
                                       seed=4)
            topk, hist = (t.cuda() for t in routing.for_rank(rank))
            plan = buf.plan(topk, hist)
            slots = plan.slot_expert_RB.cpu()
            assert int((slots >= 0).sum()) > 0
            buf.prefetch_weight(plan, layer)
            torch.cuda.synchronize()
            for p in layer.w_full:
                for j, e in enumerate(slots[rank].tolist()):
                    if e >= 0:
                        assert torch.equal(layer.w_full[p][E + j], layer.w_full[p][e]), (p, j, e)
            for p in pools.g_slots_all:
                pools.g_slots_all[p][rank].copy_(torch.randn(pools.g_slots_all[p][rank].shape, device="cuda",
                                                             generator=g))
            buf.barrier("test:filled")
            torch.cuda.synchronize()
            want = {}
            for p in layer.g_local:
                ref = layer.g_local[p].clone()
                for d in range(R):
                    for j, e in enumerate(slots[d].tolist()):
                        if e >= 0 and e // (E // R) == rank:
                            ref[e - rank * (E // R)] += pools.g_slots_all[p][d, j]
                want[p] = ref
            buf.barrier("test:read")
            buf.reduce_grad(plan, layer)
            torch.cuda.synchronize()
            for p in layer.g_local:
                assert torch.equal(layer.g_local[p], want[p]), p
                occupied = slots[rank] >= 0
                assert bool((pools.g_slots_all[p][rank][occupied.cuda()] == 0).all()), p
                pools.g_slots_all[p][rank].zero_()
            buf.barrier("test:next")
    finally:
        buf.destroy()
