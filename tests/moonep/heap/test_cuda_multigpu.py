"""CUDA VMM symmetric heap and device barrier on two GPUs.

    torchrun --nproc_per_node=2 -m pytest -q -m multigpu tests/moonep/heap/test_cuda_multigpu.py

Every rank runs every test in the same order (the tests are collective). The group is NCCL; the
heap's fd exchange uses its object collectives. Patterns are seeded per rank, so any rank can
regenerate what a peer wrote and compare bitwise.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moonep.errors import MoonEPTimeoutError
from moonep.heap import Piece, SymmetricHeap, create_heap

pytestmark = pytest.mark.multigpu

MiB = 1 << 20


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _pattern(seed: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator(_device()).manual_seed(1000 + seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=_device(), generator=gen)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got != want).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise AssertionError(f"{what}: {bad.shape[0]} of {got.numel()} elements differ; first at {i}: "
                             f"got {got[i].item()}, want {want[i].item()}")


def _all_ranks(heap: SymmetricHeap, nbytes: int, name: str):
    seg = heap.alloc(name, nbytes)
    return seg, heap.map([Piece(seg, r, 0, nbytes) for r in range(heap.world_size)])


def test_peer_writes_visible_through_contiguous_and_alias_mappings(group: dist.ProcessGroup) -> None:
    heap = create_heap(group, _device(), timeout_s=60.0)
    try:
        rank, world = heap.rank, heap.world_size
        gran = heap.granularity
        assert gran == 2 * MiB, f"VMM granularity {gran} bytes, the H200's is 2 MiB"
        n = 4 * gran
        seg, full = _all_ranks(heap, n, "visible")
        alias = heap.map([Piece(seg, rank, 0, n)])
        peer = (rank + 1) % world
        seg2 = heap.alloc("visible.second", gran)
        # a view that starts in a peer's chunk and ends in ours (the shape of W_full's last rows + slots)
        mixed = heap.map([Piece(seg2, peer, 0, gran), Piece(seg, rank, 0, n)])
        for m in (full, alias, mixed):
            assert m.bytes_u8.data_ptr() == m.addr and m.bytes_u8.device == _device()
            assert m.bytes_u8.numel() == m.nbytes
        assert int(full.bytes_u8.count_nonzero()) == 0, "new chunks must be zero-initialised"
        heap.barrier("test.visible.zero_checked")  # nobody writes before every rank checked zeros

        full.bytes_u8[rank * n : (rank + 1) * n].copy_(_pattern(rank, n))
        heap.barrier("test.visible.written")
        for r in range(world):
            _assert_bitwise(full.bytes_u8[r * n : (r + 1) * n], _pattern(r, n), f"rank {rank} reading rank {r}")
        _assert_bitwise(alias.bytes_u8, _pattern(rank, n), "alias of the local chunk")
        _assert_bitwise(mixed.bytes_u8[gran:], _pattern(rank, n), "local chunk behind a peer chunk")
        assert int(mixed.bytes_u8[:gran].count_nonzero()) == 0
        heap.barrier("test.visible.read")  # peers are done reading our chunk before we change it

        alias.bytes_u8.bitwise_not_()
        _assert_bitwise(full.bytes_u8[rank * n : (rank + 1) * n], ~_pattern(rank, n), "write via alias")
        heap.barrier("test.visible.inverted")  # checked before the peer overwrites part of it
        # a peer writes through its all-ranks view, we read through our alias
        full.bytes_u8[peer * n : peer * n + gran].fill_(rank + 7)
        heap.barrier("test.visible.peer_filled")
        src = (rank - 1) % world
        _assert_bitwise(alias.bytes_u8[:gran], torch.full((gran,), src + 7, dtype=torch.uint8, device=_device()),
                        "peer write seen through the alias")
        heap.barrier("test.visible.done")
        heap.backend.check()
    finally:
        heap.destroy()


def test_granularity_and_offset_violations_name_the_sizes(group: dist.ProcessGroup) -> None:
    heap = create_heap(group, _device(), timeout_s=60.0)
    try:
        with pytest.raises(ValueError, match=r"'odd' of 3145728 bytes is not a positive multiple of the "
                                             r"2097152-byte mapping granularity of the cuda heap"):
            heap.alloc("odd", 3 * MiB)
        seg = heap.alloc("even", 4 * MiB)
        with pytest.raises(ValueError, match=r"offset 1048576, 2097152 bytes\) is not aligned to the 2097152-byte"):
            heap.map([Piece(seg, heap.rank, MiB, 2 * MiB)])
        whole_only = r"maps whole chunks only, not 2097152 bytes at offset {} of a 4194304-byte chunk"
        with pytest.raises(ValueError, match=whole_only.format(2097152)):
            heap.map([Piece(seg, heap.rank, 0, 4 * MiB), Piece(seg, 1 - heap.rank, 2 * MiB, 2 * MiB)])
        with pytest.raises(ValueError, match=whole_only.format(0)):
            heap.map([Piece(seg, 1 - heap.rank, 0, 2 * MiB)])
        whole = heap.map([Piece(seg, heap.rank, 0, 4 * MiB)])  # the failed map left the heap usable
        assert int(whole.bytes_u8.count_nonzero()) == 0
    finally:
        heap.destroy()


def test_barrier_orders_peer_writes_1000_times_without_host_sync(group: dist.ProcessGroup,
                                                                   capsys: pytest.CaptureFixture) -> None:
    heap = create_heap(group, _device(), timeout_s=30.0)
    try:
        rank, world = heap.rank, heap.world_size
        n = heap.granularity
        _seg, full = _all_ranks(heap, world * n, "order")
        dst, src = (rank + 1) % world, (rank - 1) % world
        words = n // 4
        # rank r writes slot r of rank r+1's chunk, and reads slot r-1 of its own
        dst_slot = full.bytes_u8[(dst * world + rank) * n : (dst * world + rank + 1) * n].view(torch.int32)
        src_slot = full.bytes_u8[(rank * world + src) * n : (rank * world + src + 1) * n].view(torch.int32)
        mine = _pattern(rank, n).view(torch.int32)
        theirs = _pattern(src, n).view(torch.int32)
        assert mine.numel() == words
        heap.barrier("test.order.warmup")  # the first barrier allocates its signals (host-synchronous)
        bad = torch.zeros((), dtype=torch.int64, device=_device())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 1000
        torch.cuda.set_sync_debug_mode("error")
        try:
            start.record()
            for i in range(iters):
                torch.bitwise_xor(mine, i, out=dst_slot)  # SM stores into the peer's chunk
                heap.barrier("test.order.written")
                bad += (src_slot != (theirs ^ i)).sum()
                heap.barrier("test.order.read")
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        heap.backend.check()
        assert int(bad) == 0, f"rank {rank}: {int(bad)} words read before the peer's writes were visible"
        with capsys.disabled():
            print(f"\n[rank {rank}] {iters} x (1 MiB peer write + barrier + check + barrier): "
                  f"{start.elapsed_time(end) * 1e3 / iters:.1f} us per iteration")
    finally:
        heap.destroy()


def test_barrier_in_a_cuda_graph_orders_peer_writes(group: dist.ProcessGroup, capsys: pytest.CaptureFixture) -> None:
    """The epoch lives on the device, so one captured barrier serves every replay."""
    heap = create_heap(group, _device(), timeout_s=30.0)
    try:
        rank, world = heap.rank, heap.world_size
        n = heap.granularity
        _seg, full = _all_ranks(heap, world * n, "graph")
        dst, src = (rank + 1) % world, (rank - 1) % world
        dst_slot = full.bytes_u8[(dst * world + rank) * n : (dst * world + rank + 1) * n].view(torch.int32)
        src_slot = full.bytes_u8[(rank * world + src) * n : (rank * world + src + 1) * n].view(torch.int32)
        mine = _pattern(rank, n).view(torch.int32)
        theirs = _pattern(src, n).view(torch.int32)
        step = torch.zeros((), dtype=torch.int32, device=_device())  # advanced inside the graph, same on all ranks
        bad = torch.zeros((), dtype=torch.int64, device=_device())
        heap.barrier("test.graph.warmup")
        steps, replays = 50, 20
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(steps):
                step += 1
                torch.bitwise_xor(mine, step, out=dst_slot)
                heap.barrier("test.graph.written")
                bad += (src_slot != (theirs ^ step)).sum()
                heap.barrier("test.graph.read")
        only_barriers = torch.cuda.CUDAGraph()
        with torch.cuda.graph(only_barriers):
            for _ in range(100):
                heap.barrier("test.graph.latency")
        torch.cuda.synchronize()
        heap.barrier("test.graph.captured")
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        for _ in range(replays):
            graph.replay()
        mid.record()
        for _ in range(replays):
            only_barriers.replay()
        end.record()
        torch.cuda.synchronize()
        heap.backend.check()
        assert int(step) == steps * replays
        assert int(bad) == 0, f"rank {rank}: {int(bad)} words read before the peer's writes were visible"
        t0 = time.perf_counter()
        for _ in range(1000):
            heap.barrier("test.graph.host_cost")
        host_us = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        with capsys.disabled():
            print(f"\n[rank {rank}] CUDA graph: {start.elapsed_time(mid) * 1e3 / (steps * replays):.1f} us per "
                  f"(write + barrier + check + barrier); {mid.elapsed_time(end) * 1e3 / (100 * replays):.2f} us per "
                  f"barrier alone; eager launch costs the host {host_us:.1f} us per barrier")
    finally:
        heap.destroy()


def test_barrier_without_peer_times_out_naming_the_call(group: dist.ProcessGroup) -> None:
    timeout_s = 1.0
    heap = create_heap(group, _device(), timeout_s=timeout_s)
    try:
        heap.barrier("test.timeout.warmup")
        torch.cuda.synchronize()
        heap.backend.check()
        dist.barrier()
        if heap.rank == 0:
            t0 = time.monotonic()
            heap.barrier("test.timeout.lonely")  # rank 1 never calls it
            launch_s = time.monotonic() - t0
            assert launch_s < 0.25, f"the barrier blocked the host for {launch_s:.3f} s"
            torch.cuda.synchronize()
            waited_s = time.monotonic() - t0
            assert timeout_s <= waited_s < timeout_s + 5.0, f"the barrier gave up after {waited_s:.2f} s"
            with pytest.raises(MoonEPTimeoutError, match=r"'test\.timeout\.lonely' \(barrier number 2\) timed "
                                                         r"out on rank 0 after 1\.0 s: ranks \[1\] did not arrive"):
                heap.backend.check()
            t1 = time.monotonic()
            with pytest.raises(MoonEPTimeoutError, match=r"'test\.timeout\.lonely'"):
                heap.barrier("test.timeout.next")
            assert time.monotonic() - t1 < 0.25
        dist.barrier()
    finally:
        heap.destroy()


def test_destroy_is_idempotent_and_returns_the_memory(group: dist.ProcessGroup) -> None:
    nbytes = 512 * MiB
    free_before_alloc = torch.cuda.mem_get_info()[0]
    heap = create_heap(group, _device(), timeout_s=60.0)
    _seg, _full = _all_ranks(heap, nbytes, "big")
    heap.barrier("test.destroy.used")
    torch.cuda.synchronize()
    free_allocated = torch.cuda.mem_get_info()[0]
    assert free_before_alloc - free_allocated >= nbytes, (free_before_alloc, free_allocated)
    dist.barrier()
    heap.destroy()
    heap.destroy()
    dist.barrier()  # the peers have released their imports of our chunk too
    free_after = torch.cuda.mem_get_info()[0]
    assert free_after - free_allocated >= nbytes - 16 * MiB, (free_allocated, free_after)
    with pytest.raises(RuntimeError, match=r"used after destroy\(\) \(in alloc\(again\)\)"):
        heap.alloc("again", 2 * MiB)
    with pytest.raises(RuntimeError, match=r"used after destroy\(\) \(in test\.destroy\.after\)"):
        heap.barrier("test.destroy.after")


def test_peer_write_bandwidth(group: dist.ProcessGroup, capsys: pytest.CaptureFixture) -> None:
    heap = create_heap(group, _device(), timeout_s=60.0)
    try:
        rank, world = heap.rank, heap.world_size
        n = 256 * MiB
        _seg, full = _all_ranks(heap, n, "bandwidth")
        dst, src = (rank + 1) % world, (rank - 1) % world
        peer = full.bytes_u8[dst * n : (dst + 1) * n]
        data = _pattern(rank, n)
        results = {}
        for how in ("copy engine (copy_)", "SM stores (bitwise_xor out=)"):
            times = []
            for it in range(13):
                heap.barrier("test.bandwidth.start")  # both directions run at once
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if how.startswith("copy"):
                    peer.copy_(data)
                else:
                    torch.bitwise_xor(data, 0, out=peer)
                end.record()
                torch.cuda.synchronize()
                if it >= 3:
                    times.append(start.elapsed_time(end) * 1e-3)
            results[how] = n / sorted(times)[len(times) // 2] / 1e9
        heap.barrier("test.bandwidth.done")
        _assert_bitwise(full.bytes_u8[rank * n : (rank + 1) * n], _pattern(src, n), "bytes the peer wrote")
        heap.barrier("test.bandwidth.checked")
        with capsys.disabled():
            for how, gbs in results.items():
                print(f"\n[rank {rank}] peer writes through the all-ranks mapping, {n // MiB} MiB, both directions "
                      f"at once, {how}: {gbs:.0f} GB/s per direction (median of 10)")
        assert min(results.values()) > 100, f"peer writes at {results} GB/s: not over NVLink?"
    finally:
        heap.destroy()
