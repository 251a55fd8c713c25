"""Buffer.dispatch_async / combine_async (moonep.comm_stream) on the CPU heap: the same bits as the
synchronous calls, a completed CommEvent, and async and sync calls mixed in one sequence. The
stream ordering itself is tested on 2 GPUs (tests/moonep/test_comm_stream_multigpu.py)."""

from __future__ import annotations

import torch

from moonep import Buffer, BufferConfig
from moonep.comm_stream import CommEvent
from moonep.routing import generate_routing
from tests.dist_utils import run_ranks

E, K, S, H = 8, 2, 16, 32


def _async_rank(rank: int, world: int) -> list[str]:
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4))
    failures = []

    def same(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        if (got is None) != (want is None) or (got is not None and not torch.equal(got, want)):
            failures.append(f"rank {rank}: {what} differs between the async and the sync call")

    try:
        assert buf.comm_stream is None  # the CPU has no streams
        routing = generate_routing(num_ranks=world, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=2.0,
                                   seed=5)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(S, H, generator=g).to(torch.bfloat16)
        w = torch.rand(S, K, generator=g)
        topk = routing.topk_RsK[rank]
        sync = buf.dispatch(x, w, topk)
        want_rows, want_w, plan = sync.x_rows.clone(), sync.weights_rows.clone(), sync.plan
        y_rows = torch.randn(plan.nvs_s, H, generator=g).to(torch.bfloat16)
        scal = torch.randn(plan.nvs_s, generator=g)
        want_y, want_s = buf.combine(plan, y_rows, row_scalars=scal)

        res, done = buf.dispatch_async(x, w, topk)
        if not isinstance(done, CommEvent) or not done.query():
            failures.append(f"rank {rank}: a CPU async dispatch must return a completed CommEvent, got {done!r}")
        done.wait()
        done.synchronize()
        same("dispatched rows", res.x_rows, want_rows)
        same("dispatched weights", res.weights_rows, want_w)
        same("plan.dst_row_sK", res.plan.dst_row_sK, plan.dst_row_sK)
        (y, s), done = buf.combine_async(res.plan, y_rows, row_scalars=scal)
        done.wait()
        same("combined rows", y, want_y)
        same("combined scalars", s, want_s)
        # mixed: an async dispatch with the saved plan, then a synchronous combine
        res, done = buf.dispatch_async(x, w, plan=plan)
        done.wait()
        same("saved-plan rows", res.x_rows, want_rows)
        y, s = buf.combine(plan, y_rows, row_scalars=scal)
        same("combine after an async dispatch", y, want_y)
    finally:
        buf.destroy()
    return failures


def test_async_calls_equal_sync_calls_on_cpu() -> None:
    failures = [f for fs in run_ranks(_async_rank, 2) for f in fs]
    assert not failures, "\n".join(failures)
