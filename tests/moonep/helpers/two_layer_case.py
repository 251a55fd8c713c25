"""Two MoE layers in a row on one Buffer/ExpertPools, shared by the CPU test (test_moe_layer.py) and
the GPU test (datapath/test_reference_multigpu.py).

Chained, layer 1's backward refills the shared slots with layer 0's copies right after its own last
read of them (ExpertPools.previous_forward) and leaves its reduce_grad queued (reduce_grad_async).
Neither may change a bit: every output and gradient must equal the same two layers run one at a time
(layer 1 alone on layer 0's output, then layer 0 alone with the input gradient layer 1 returned),
where layer 0's backward re-prefetches on its own. The call log pins down the schedule.
"""

from __future__ import annotations

import torch

from moonep import Buffer, BufferConfig, ExpertPools, expert_glu, glu_projections
from moonep.routing import generate_routing
from tests.moonep.helpers.moe_reference import merged

# chained: fwd 0, fwd 1, then in 1's backward the early copy of layer 0 before 1's combine; reduce_grad
# of each layer after its backward combine; layer 0's backward finds its copies in place
CHAINED_LOG = [("prefetch", 0), ("combine",), ("prefetch", 1), ("combine",),
               ("prefetch", 0), ("combine",), ("reduce_grad", 1),
               ("combine",), ("reduce_grad", 0)]
# ExpertPools.chain_prefetch off (activation checkpointing): layer 0's backward refills the slots itself
UNCHAINED_LOG = [("prefetch", 0), ("combine",), ("prefetch", 1), ("combine",),
                 ("combine",), ("reduce_grad", 1),
                 ("prefetch", 0), ("combine",), ("reduce_grad", 0)]


def _inputs(R: int, E: int, H: int, F: int, K: int, S: int):
    g = torch.Generator().manual_seed(77)
    x = torch.randn(R, S, H, generator=g).to(torch.bfloat16)
    ws, topks, route = [], [], []
    for layer, maxvio in enumerate((2.5, 1.5)):  # two different routings: different slot contents
        ws.append(merged({"gate": (torch.randn(E, H, F, generator=g) / H**0.5).to(torch.bfloat16),
                          "up": (torch.randn(E, H, F, generator=g) / H**0.5).to(torch.bfloat16),
                          "down": (torch.randn(E, F, H, generator=g) / F**0.5).to(torch.bfloat16)}))
        maxvio = min(maxvio, E / K - 1 - 0.1)
        topks.append(generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K,
                                      target_maxvio=maxvio, seed=11 + layer).topk_RsK)
        route.append(torch.rand(R, S, K, generator=g))
    grad_y = torch.randn(R, S, H, generator=g).to(torch.bfloat16)
    return x, ws, topks, route, grad_y


def run_two_layers(rank: int, R: int, group, *, E: int, H: int, F: int, K: int, S: int, chain: bool = True) -> dict:
    """Runs both schedules on this rank (group None: the default group; the Buffer picks the device);
    returns what the caller compares, on the CPU."""
    x, ws, topks, route, grad_y = _inputs(R, E, H, F, K, S)
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4), group)
    dev = buf.device
    try:
        pools = ExpertPools(buf, glu_projections(H, F))
        pools.chain_prefetch = chain
        layers = [pools.add_layer(), pools.add_layer()]
        epn = E // R
        for layer, w in zip(layers, ws, strict=True):
            for p in w:
                layer.w_local[p].copy_(w[p][rank * epn:(rank + 1) * epn])
        log: list[tuple] = []
        plans: dict[int, object] = {}  # layer -> the plan its last prefetch copied (slots counted after the run)
        _record(pools, buf, log, plans)
        xs = x[rank].to(dev)
        topk = [t[rank].to(dev) for t in topks]
        rw = [r[rank].to(dev) for r in route]
        gy = grad_y[rank].to(dev)

        def grads() -> list[dict[str, torch.Tensor]]:
            buf.wait_pending()
            out = [{p: layer.g_local[p].cpu().clone() for p in layer.g_local} for layer in layers]
            for layer in layers:
                for p in layer.g_local:
                    layer.g_local[p].zero_()
            return out

        # chained
        x0 = xs.clone().requires_grad_()
        w0, w1 = rw[0].clone().requires_grad_(), rw[1].clone().requires_grad_()
        y0 = expert_glu(buf, pools, layers[0], x0, w0, topk[0])
        y1 = expert_glu(buf, pools, layers[1], y0, w1, topk[1])
        y1.backward(gy)
        chained_log = list(log)
        chained = {"y1": y1.detach().cpu(), "gx": x0.grad.cpu(), "gw0": w0.grad.cpu(), "gw1": w1.grad.cpu(),
                   "g": grads(), "slots": {i: int((p.slot_expert_RB >= 0).sum()) for i, p in plans.items()}}
        plans.clear()

        # one layer at a time
        y0_in = y0.detach().clone().requires_grad_()
        w1b = rw[1].clone().requires_grad_()
        y1b = expert_glu(buf, pools, layers[1], y0_in, w1b, topk[1])
        y1b.backward(gy)
        x0b, w0b = xs.clone().requires_grad_(), rw[0].clone().requires_grad_()
        y0b = expert_glu(buf, pools, layers[0], x0b, w0b, topk[0])
        y0b.backward(y0_in.grad)
        alone = {"y1": y1b.detach().cpu(), "gx": x0b.grad.cpu(), "gw0": w0b.grad.cpu(), "gw1": w1b.grad.cpu(),
                 "g": grads()}
        reduce_zero = all(bool((pools.g_slots_all[p][rank] == 0).all()) for p in pools.projections)
        return {"log": chained_log, "chained": chained, "alone": alone, "reduce_pool_zero": reduce_zero,
                "chain": chain}
    finally:
        buf.destroy()


def _record(pools: ExpertPools, buf: Buffer, log: list, plans: dict) -> None:
    """Log prefetches (with their layer), combines and reduce_grads in call order (instance wrappers).
    Nothing here reads the device: a host sync inside the side-stream prefetch would order it after
    the main stream's GEMMs and hide a missing stream wait."""
    prefetch, combine, reduce_grad = pools.prefetch, buf.combine, buf.reduce_grad

    def logged_prefetch(plan, layer):
        log.append(("prefetch", layer.index))
        plans[layer.index] = plan
        return prefetch(plan, layer)

    def logged_combine(*args, **kwargs):
        log.append(("combine",))
        return combine(*args, **kwargs)

    def logged_reduce_grad(plan, layer):
        log.append(("reduce_grad", layer.index))
        return reduce_grad(plan, layer)

    pools.prefetch, buf.combine, buf.reduce_grad = logged_prefetch, logged_combine, logged_reduce_grad


def check_two_layers(out: dict) -> None:
    """The call log, and every output and gradient bitwise equal between the two schedules."""
    want_log = CHAINED_LOG if out["chain"] else UNCHAINED_LOG
    assert out["log"] == want_log, f"schedule {out['log']}, expected {want_log}"
    assert all(n > 0 for n in out["chained"]["slots"].values()), \
        f"both routings must fill slots (else the early copy moves nothing): {out['chained']['slots']}"
    c, a = out["chained"], out["alone"]
    for key in ("y1", "gx", "gw0", "gw1"):
        assert torch.equal(c[key], a[key]), f"{key} differs between the chained and the one-at-a-time run"
    for i in range(2):
        for p in c["g"][i]:
            assert torch.equal(c["g"][i][p], a["g"][i][p]), f"grad of layer {i} {p} differs"
            assert bool(c["g"][i][p].abs().sum() > 0), f"grad of layer {i} {p} is zero: the test checks nothing"
    assert out["reduce_pool_zero"], "reduce_grad must leave the reduce pool zero"
