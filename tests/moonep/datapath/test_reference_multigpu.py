"""The pure-PyTorch moonep path on CUDA over the VMM heap equals the CPU specification.

Run on the 2xH200 machine: torchrun --nproc_per_node=2 -m pytest -q -m multigpu tests/moonep/datapath/test_reference_multigpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, expert_glu, glu_projections, make_plan
from moonep.layout import Layout
from moonep.routing import generate_routing
from tests.moonep import test_moe_layer as cpu_moe
from tests.moonep.helpers.moe_reference import reference_grads
from tests.moonep.helpers.two_layer_case import check_two_layers, run_two_layers

pytestmark = pytest.mark.multigpu


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got.view(-1) != want.view(-1)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise AssertionError(f"{what}: {bad.numel()} elements differ, first at flat {i}: "
                             f"got {got.view(-1)[i].item()}, want {want.view(-1)[i].item()}")


S, H, F, K, E = 256, 1024, 1024, 8, 32  # H*F*2 bytes = 2 MiB: one expert row per VMM granule


@pytest.mark.parametrize("maxvio", [0.0, 1.0, 2.5])
def test_plans_and_rows_bitwise_equal_cpu_spec(group: dist.ProcessGroup, maxvio: float) -> None:
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio, seed=3)
    gen = torch.Generator().manual_seed(11)
    x_all = torch.randn(R, S, H, generator=gen).to(torch.bfloat16)
    w_all = torch.rand(R, S, K, generator=gen)
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E), group)
    try:
        topk, hist = routing.for_rank(rank)
        res = buf.dispatch(x_all[rank].cuda(), w_all[rank].cuda(), topk.cuda(), hist.cuda())
        layout = Layout(buf.config, R, 4096)
        ref = make_plan(layout, rank, topk, routing.tokens_per_expert_RE)
        for name, value in vars(ref).items():
            if isinstance(value, torch.Tensor):
                _first_mismatch(getattr(res.plan, name).cpu(), value, f"plan.{name}")
            else:
                assert getattr(res.plan, name) == value, name
        # reference rows: every rank's plan computed on the CPU, rows gathered directly
        want = torch.zeros(ref.nvs_s, H, dtype=torch.bfloat16)
        want_w = torch.zeros(ref.nvs_s)
        for src in range(R):
            p = make_plan(layout, src, routing.topk_RsK[src], routing.tokens_per_expert_RE)
            mine = p.dst_rank_sK == rank
            t_idx = torch.arange(S)[:, None].expand(S, K)[mine]
            want[p.dst_row_sK[mine].long()] = x_all[src][t_idx]
            want_w[p.dst_row_sK[mine].long()] = w_all[src][mine]
        _first_mismatch(res.x_rows.cpu(), want, "dispatched rows")
        _first_mismatch(res.weights_rows.cpu(), want_w, "dispatched route weights")
    finally:
        buf.destroy()


@pytest.mark.parametrize("fused", [False, True], ids=["grouped_mm", "fused_expert_gemm"])
@pytest.mark.parametrize("activation", ["swiglu", "situ_glu"])
def test_moe_layer_matches_dense_reference_on_gpu(group: dist.ProcessGroup, activation: str, fused: bool) -> None:
    """The Triton path with the op's activation fused (SiTU-GLU: K3's experts), and with the fused expert
    GEMMs (BufferOptions.fused_expert_gemm), against the textbook formula."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    Hs, Fs, Ks, Ss, Es = 512, 2048, 4, 64, 16  # 512*2048*2 B = 2 MiB per expert row
    x, w, topk, weights, grad_y = cpu_moe._problem(R, Es, 2.5, H=Hs, F=Fs, K=Ks, S=Ss)
    buf = Buffer(BufferConfig(max_tokens=Ss, hidden=Hs, topk=Ks, num_experts=Es,
                              options=BufferOptions(fused_expert_gemm=fused)), group)
    try:
        pools = ExpertPools(buf, glu_projections(Hs, Fs))
        layer = pools.add_layer()
        epn = Es // R
        for p in w:
            layer.w_local[p].copy_(w[p][rank * epn:(rank + 1) * epn].cuda())
        x_sH = x[rank].cuda().requires_grad_()
        w_sK = weights[rank].cuda().requires_grad_()
        y = expert_glu(buf, pools, layer, x_sH, w_sK, topk[rank].cuda(), activation=activation)
        (y.double() * grad_y[rank].cuda().double()).sum().backward()
        buf.wait_pending()  # backward leaves reduce_grad queued on the communication stream
        assert int((pools.slot_plan.slot_expert_RB >= 0).sum()) > 0, "skewed routing should use slots"
        got = {"y": y.detach(), "gx": x_sH.grad, "gw": w_sK.grad, **{p: layer.g_local[p] for p in w}}
        gathered = {}
        for k, v in got.items():
            parts = [torch.empty_like(v) for _ in range(R)]
            dist.all_gather(parts, v.contiguous(), group=group)
            gathered[k] = torch.cat(parts).cpu()
        N = R * Ss
        y16, gx16, gw16, gW16 = reference_grads(x.view(N, Hs), weights.view(N, Ks), topk.view(N, Ks), w,
                                                grad_y.view(N, Hs), torch.bfloat16, activation)
        y64, gx64, gw64, gW64 = reference_grads(x.view(N, Hs), weights.view(N, Ks), topk.view(N, Ks), w,
                                                grad_y.view(N, Hs), torch.float64, activation)
        cpu_moe._close("y", gathered["y"], y16, y64)
        cpu_moe._close("grad x", gathered["gx"], gx16, gx64)
        cpu_moe._close("grad route weights", gathered["gw"], gw16, gw64)
        for p in w:
            cpu_moe._close(f"grad W_{p}", gathered[p], gW16[p], gW64[p])
    finally:
        buf.destroy()


def test_dispatch_combine_without_host_sync(group: dist.ProcessGroup) -> None:
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=2.0, seed=5)
    topk, hist = (t.cuda() for t in routing.for_rank(rank))
    x = torch.randn(S, H, device="cuda").to(torch.bfloat16)
    w = torch.rand(S, K, device="cuda")
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E,
                              options=BufferOptions(check_values=False)), group)
    try:
        pools = ExpertPools(buf, {"w": (H, F)})
        layer = pools.add_layer()
        warm = buf.dispatch(x, w, topk, hist)  # first call per shape captures the planner graph / compiles
        buf.combine(warm.plan, warm.x_rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                res = buf.dispatch(x, w, topk, hist)
                buf.prefetch_weight(res.plan, layer)
                y, _ = buf.combine(res.plan, res.x_rows)
                g = buf.dispatch(y, plan=res.plan).x_rows
                buf.combine(res.plan, g, row_scalars=res.weights_rows)
                buf.reduce_grad(res.plan, layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        # y = sum over k of the dispatched copies of x = K * x (bf16 sum in fp32, then rounded)
        torch.testing.assert_close(y.float(), (x.float() * K).to(torch.bfloat16).float(), rtol=0, atol=0)
    finally:
        buf.destroy()


def test_two_layers_early_prefetch_and_async_reduce_grad_change_no_bit(group: dist.ProcessGroup) -> None:
    """On the kernel path, with the side-stream prefetch and reduce_grad on the communication
    stream for real: the chained layers equal the layers run one at a time, bitwise."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    check_two_layers(run_two_layers(rank, R, group, E=16, H=512, F=1024, K=4, S=64))
