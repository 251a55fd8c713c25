"""The expert-side kernels (moonep.kernels.experts: prefetch, reduce_grad into the owner, slot zeroing) in
Triton's interpreter on the CPU, bitwise against the PyTorch path (copies and fp32 adds in a fixed order)
at R = 2 and 4.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and installs the interpreter's shims
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from tests.dist_utils import run_ranks


def _expert_kernels_rank(rank: int, world: int) -> list[int]:
    from moonep import Buffer, BufferConfig, ExpertPools
    from moonep.kernels import experts as kx
    from moonep.routing import generate_routing

    E, H, F, K, S = 8 * world, 32, 64, 4, 48
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4))
    try:
        pools = ExpertPools(buf, {"gate": (H, F), "down": (F, H)})
        layer = pools.add_layer()
        g = torch.Generator().manual_seed(rank)
        for p, w in layer.w_local.items():
            w.copy_(torch.randn(w.shape, generator=g).to(w.dtype))
            layer.g_local[p].copy_(torch.randn(layer.g_local[p].shape, generator=g))
        buf.barrier("test:init")
        used = []
        for maxvio in (0.5, 3.0):
            routing = generate_routing(num_ranks=world, tokens_per_rank=S, num_experts=E, topk=K,
                                       target_maxvio=maxvio, seed=3)
            plan = buf.plan(*routing.for_rank(rank))
            occupied = plan.slot_expert_RB[rank] >= 0
            pools.prefetch(plan, layer)  # the PyTorch path
            want_w = {p: layer.w_full[p][E:].clone() for p in layer.w_full}
            for p in layer.w_full:
                layer.w_full[p][E:].zero_()
                kx.prefetch(layer.w_full[p], plan.slot_expert_RB, rank, E)
                assert torch.equal(layer.w_full[p][E:][occupied], want_w[p][occupied]), f"prefetch {p}"
            for p in pools.g_slots_all:
                pools.g_slots_all[p][rank].copy_(torch.randn(pools.g_slots_all[p][rank].shape, generator=g))
            saved = {p: (layer.g_local[p].clone(), pools.g_slots_all[p][rank].clone()) for p in layer.g_local}
            pools.reduce_grad(plan, layer)  # the PyTorch path
            want_g = {p: layer.g_local[p].clone() for p in layer.g_local}
            buf.barrier("test:reference-done")
            for p, (g_local, slots) in saved.items():
                layer.g_local[p].copy_(g_local)
                pools.g_slots_all[p][rank].copy_(slots)
            buf.barrier("test:restored")
            for p in layer.g_local:
                kx.reduce_into_owner(layer.g_local[p], pools.g_slots_all[p], plan.slot_expert_RB, rank)
            buf.barrier("test:read")
            for p in layer.g_local:
                kx.zero_slots(pools.g_slots_all[p], plan.slot_expert_RB, rank)
                assert torch.equal(layer.g_local[p], want_g[p]), f"reduce_grad {p}"
                assert bool((pools.g_slots_all[p][rank][occupied] == 0).all()), f"zeroed slots {p}"
                pools.g_slots_all[p][rank].zero_()
            used.append(int((plan.slot_expert_RB >= 0).sum()))
            buf.barrier("test:next")
        return used
    finally:
        buf.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_kernels_match_pytorch_path(world: int) -> None:
    used = run_ranks(_expert_kernels_rank, world, timeout_s=300)
    assert all(n > 0 for n in used[0]), f"routings should occupy slots: {used}"
