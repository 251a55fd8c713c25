"""The triton data path (moonep.kernels.dispatch_combine) equals the pure-PyTorch path bitwise.

Run on the 2xH200 machine: torchrun --nproc_per_node=2 -m pytest -q -m multigpu tests/moonep/kernels/test_dispatch_combine_multigpu.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions
from moonep.routing import generate_routing

pytestmark = pytest.mark.multigpu


S, H, K, E = 256, 1024, 8, 32  # max maxvio for E=32, K=8 is E/K - 1 = 3


def _bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    g = got.contiguous().view(as_int.get(got.dtype, got.dtype)).reshape(-1)
    w = want.contiguous().view(as_int.get(want.dtype, want.dtype)).reshape(-1)
    bad = (g != w).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise AssertionError(f"{what}: {bad.numel()} elements differ, first at flat {i}: "
                             f"got {got.reshape(-1)[i].item()}, want {want.reshape(-1)[i].item()}")


def _buffers(group: dist.ProcessGroup, hidden: int = H, **options) -> tuple[Buffer, Buffer]:
    """The PyTorch path and the Triton path; MOONEP_TEST_SCATTER_TILE=n sets the triton scatter's tile
    (tile sweeps)."""
    cfg = dict(max_tokens=S, hidden=hidden, topk=K, num_experts=E)
    tile = int(os.environ.get("MOONEP_TEST_SCATTER_TILE", BufferOptions().scatter_tile))
    return (Buffer(BufferConfig(**cfg, options=BufferOptions(kernels="torch", timeout_s=30.0, **options)), group),
            Buffer(BufferConfig(**cfg, options=BufferOptions(kernels="triton", timeout_s=30.0, scatter_tile=tile,
                                                             **options)), group))


def _routing(rank: int, R: int, s: int, maxvio: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    routing = generate_routing(num_ranks=R, tokens_per_rank=s, num_experts=E, topk=K, target_maxvio=maxvio, seed=seed)
    return tuple(t.cuda() for t in routing.for_rank(rank))


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


def _inputs(buf: Buffer, rank: int, s: int, hidden: int, maxvio: float) -> dict[str, torch.Tensor]:
    """Routing and data of one step, built before any timed or sync-checked region."""
    R, nvs_s = buf.num_ranks, buf.layout.nvs_rows(s * K)
    topk, hist = _routing(rank, R, s, maxvio, seed=3)
    topk2, hist2 = _routing(rank, R, s, 1.5, seed=4)
    w = torch.rand(s, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(20 + rank))
    return {"topk": topk, "hist": hist, "topk2": topk2, "hist2": hist2, "x": _randn((s, hidden), 10 + rank), "w": w,
            "g": _randn((s, hidden), 30 + rank), "y": _randn((nvs_s, hidden), 40 + rank),
            "scalars": _randn((nvs_s,), 50 + rank, torch.float32), "gy": _randn((nvs_s, hidden), 60 + rank)}


def _sequence(buf: Buffer, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every data-path call of a training step, outputs cloned (the buffer rows are reused)."""
    out: dict[str, torch.Tensor] = {}
    res = buf.dispatch(inp["x"], inp["w"], inp["topk"], inp["hist"])
    plan = res.plan
    out["x_rows"], out["weights_rows"] = res.x_rows.clone(), res.weights_rows.clone()
    res2 = buf.dispatch(inp["g"], plan=plan)  # combine's backward: saved plan, no route weights
    out["saved_plan_rows"], out["saved_plan_weights"] = res2.x_rows.clone(), res2.weights_rows.clone()
    out["y"] = buf.combine(plan, inp["y"])[0].clone()
    gx, gw = buf.combine(plan, inp["gy"], row_scalars=inp["scalars"])
    out["grad_x"], out["grad_w"] = gx.clone(), gw.clone()
    buf.combine_input(plan).copy_(inp["y"])  # zero-copy input
    out["y_zero_copy"] = buf.combine(plan, buf.combine_input(plan))[0].clone()
    other = buf.dispatch(inp["x"], inp["w"], inp["topk2"], inp["hist2"])
    out["x_rows_other"] = other.x_rows.clone()
    out["y_stale_plan"] = buf.combine(plan, inp["y"])[0].clone()  # plan is not the last dispatched one
    out["weights_other_after_combine"] = other.weights_rows.clone()  # the refresh left them alone
    return out


@pytest.mark.parametrize("maxvio,s,hidden", [(0.0, S, H), (1.0, S, H), (2.9, S, H), (2.0, S - 37, 1000)])
def test_destination_reduce_triton_bitwise_equals_torch_path(group: dist.ProcessGroup, maxvio: float, s: int,
                                                             hidden: int) -> None:
    """BufferOptions.combine_reduce="destination": the training step's calls, plus combine with the
    route weights (row_weights) and with two row tensors added (add_rows), as moonep.expert_glu issues them."""
    rank = dist.get_rank(group)
    ref, fast = _buffers(group, hidden, combine_reduce="destination")
    try:
        inp = _inputs(ref, rank, s, hidden, maxvio)
        outs = []
        for buf in (ref, fast):
            out = _sequence(buf, inp)
            res = buf.dispatch(inp["x"], inp["w"], inp["topk"], inp["hist"])
            w_rows = res.weights_rows.clone()
            out["y_weighted"] = buf.combine(res.plan, inp["y"], row_weights=w_rows)[0].clone()
            gx, gw = buf.combine(res.plan, inp["gy"], row_scalars=inp["scalars"], add_rows=inp["y"])
            out["grad_x_two_halves"], out["grad_w_two_halves"] = gx.clone(), gw.clone()
            outs.append(out)
        torch.cuda.synchronize()
        want, got = outs
        for name in want:
            _bitwise(got[name], want[name], f"rank {rank} maxvio {maxvio} destination: {name}")
    finally:
        fast.destroy()
        ref.destroy()


@pytest.mark.parametrize("maxvio,s,hidden", [(0.0, S, H), (0.2, S, H), (1.0, S, H), (2.9, S, H), (2.0, S - 37, 1000)])
def test_triton_path_bitwise_equals_torch_path(group: dist.ProcessGroup, maxvio: float, s: int, hidden: int) -> None:
    rank = dist.get_rank(group)
    ref, fast = _buffers(group, hidden)
    try:
        inp = _inputs(ref, rank, s, hidden, maxvio)
        want = _sequence(ref, inp)
        got = _sequence(fast, inp)
        torch.cuda.synchronize()
        for name in want:
            _bitwise(got[name], want[name], f"rank {rank} maxvio {maxvio}: {name}")
    finally:
        fast.destroy()
        ref.destroy()


def test_triton_path_without_host_sync(group: dist.ProcessGroup) -> None:
    rank = dist.get_rank(group)
    ref, fast = _buffers(group, check_values=False)
    try:
        inp = _inputs(ref, rank, S, H, 2.5)
        want = _sequence(ref, inp)
        _sequence(fast, inp)  # compile every kernel variant first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _sequence(fast, inp)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for name in want:
            _bitwise(got[name], want[name], f"rank {rank} sync-free: {name}")
    finally:
        fast.destroy()
        ref.destroy()


def test_dispatch_combine_sum_of_copies(group: dist.ProcessGroup) -> None:
    """Not against the torch path: combine(dispatch(x)) = K * x (each row sums K bf16 copies)."""
    rank = dist.get_rank(group)
    fast = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E,
                               options=BufferOptions(kernels="triton", timeout_s=30.0)), group)
    try:
        topk, hist = _routing(rank, fast.num_ranks, S, 2.9, seed=7)
        x = _randn((S, H), 70 + rank)
        res = fast.dispatch(x, None, topk, hist)
        y, _ = fast.combine(res.plan, res.x_rows)
        _bitwise(y, (x.float() * K).to(torch.bfloat16), f"rank {rank}: combine(dispatch(x))")
    finally:
        fast.destroy()


def test_cuda_graph_of_saved_plan_dispatch_and_combine(group: dist.ProcessGroup) -> None:
    rank = dist.get_rank(group)
    ref, fast = _buffers(group, check_values=False)
    try:
        topk, hist = _routing(rank, fast.num_ranks, S, 2.0, seed=9)
        x = _randn((S, H), 80 + rank)
        plan = fast.dispatch(x, None, topk, hist).plan
        plan_ref = ref.dispatch(x, None, topk, hist).plan
        g_in = torch.zeros(S, H, dtype=torch.bfloat16, device="cuda")
        y_in = torch.zeros(plan.nvs_s, H, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile outside the capture
            fast.dispatch(g_in, plan=plan)
            fast.combine(plan, y_in)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            rows = fast.dispatch(g_in, plan=plan).x_rows
            y_out, _ = fast.combine(plan, y_in)
        for step in range(3):
            g_in.copy_(_randn((S, H), 90 + 10 * step + rank))
            y_in.copy_(_randn((plan.nvs_s, H), 91 + 10 * step + rank))
            graph.replay()
            got_rows, got_y = rows.clone(), y_out.clone()
            want_rows = ref.dispatch(g_in, plan=plan_ref).x_rows.clone()
            want_y = ref.combine(plan_ref, y_in)[0]
            torch.cuda.synchronize()
            _bitwise(got_rows, want_rows, f"rank {rank} graph replay {step}: rows")
            _bitwise(got_y, want_y, f"rank {rank} graph replay {step}: y")
    finally:
        fast.destroy()
        ref.destroy()
