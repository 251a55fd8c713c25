"""dispatch_async / combine_async on 2 GPUs: the communication stream waits for the inputs the
caller's stream is still producing, the results equal the synchronous calls bit for bit while the
caller's stream runs other work, a synchronous call after an async one (a plan with other routing,
a combine) is ordered after it, and no call synchronises with the host.

Run on the 2xH200 machine: torchrun --nproc_per_node=2 -m pytest -q -m multigpu tests/moonep/test_comm_stream_multigpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions
from moonep.routing import generate_routing

pytestmark = pytest.mark.multigpu

S, H, K, E = 2048, 1024, 8, 32
_LATE = 20_000_000  # ~10 ms of GPU sleep: the caller's stream produces the inputs late


def test_async_calls_order_and_equal_sync(group: dist.ProcessGroup) -> None:
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=3.0, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(S, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.rand(S, K, device="cuda", generator=gen)
    topk = routing.topk_RsK[rank].cuda()
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, options=BufferOptions(check_values=False, timeout_s=60.0)),
                 group)
    try:
        assert buf.comm_stream is not None and buf.comm_stream != torch.cuda.current_stream()
        sync = buf.dispatch(x, w, topk)
        plan = sync.plan
        want_rows, want_w = sync.x_rows.clone(), sync.weights_rows.clone()
        y_rows = torch.randn(plan.nvs_s, H, device="cuda", generator=gen).to(torch.bfloat16)
        scal = torch.randn(plan.nvs_s, device="cuda", generator=gen)
        want_y, want_s = buf.combine(plan, y_rows, row_scalars=scal)
        # a second routing, planned synchronously while an async dispatch is still pending
        routing2 = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=0.5, seed=8)
        topk2 = routing2.topk_RsK[rank].cuda()
        want_dst2 = buf.plan(topk2).dst_row_sK.clone()
        a = torch.randn(4096, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        want_mm = a @ a
        torch.cuda.synchronize()

        torch.cuda.set_sync_debug_mode("error")
        try:
            for it in range(3):
                # inputs written late on the caller's stream: the comm stream must wait for them
                x_late, y_late = torch.empty_like(x), torch.empty_like(y_rows)
                torch.cuda._sleep(_LATE)
                x_late.copy_(x)
                y_late.copy_(y_rows)
                res, done = buf.dispatch_async(x_late, w, topk)
                mm = a @ a  # the caller's stream keeps working meanwhile
                dst2 = buf.plan(topk2).dst_row_sK  # sync call before the wait: must queue after it
                done.wait()
                rows, wts = res.x_rows.clone(), res.weights_rows.clone()
                (y, s), done = buf.combine_async(res.plan, y_late, row_scalars=scal)
                done.wait()
                # an async dispatch with the saved plan, then a synchronous combine right after it
                buf.dispatch_async(x, w, plan=res.plan)
                y2, _ = buf.combine(res.plan, y_rows)
                torch.cuda.set_sync_debug_mode("default")
                for what, got, want in (("rows", rows, want_rows), ("weights", wts, want_w), ("combine y", y, want_y),
                                        ("combine scalars", s, want_s), ("overlapped matmul", mm, want_mm),
                                        ("sync combine after async dispatch", y2, want_y),
                                        ("sync plan while an async dispatch was pending", dst2, want_dst2)):
                    assert torch.equal(got, want), f"rank {rank} iteration {it}: {what} differs from the sync call"
                torch.cuda.set_sync_debug_mode("error")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        buf.destroy()
