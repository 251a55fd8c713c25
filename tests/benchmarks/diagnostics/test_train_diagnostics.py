"""bench_train's memory-peak analysis on a hand-made allocator history (the GPU run feeds it
torch.cuda.memory._snapshot(); the arithmetic is checked here)."""

from __future__ import annotations

from benchmarks.diagnostics.train_diagnostics import _peak_allocations


def _ev(action: str, addr: int, size: int, where: str) -> dict:
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": f"/x/moonep/{where}.py", "line": 7, "name": "f"},
                       {"filename": "/usr/lib/python3/threading.py", "line": 1, "name": "run"}]}


def test_peak_and_the_allocations_live_at_it() -> None:
    events = [_ev("alloc", 1, 100, "a"), _ev("alloc", 2, 50, "b"), _ev("segment_alloc", 9, 4096, "a"),
              _ev("free_requested", 1, 100, "a"), _ev("free_completed", 1, 100, "a"),
              _ev("alloc", 3, 200, "c"), _ev("alloc", 4, 200, "c"),  # peak: b 50 + c 400 = 450
              _ev("free_requested", 3, 200, "c"), _ev("free_requested", 77, 1000, "old"),  # a block from before
              _ev("alloc", 5, 300, "d")]  # 550 - 1000: never above the peak again
    text, peak = _peak_allocations({"device_traces": [events, []]}, start=1000, top=10)
    assert peak == 450
    assert "peak 1,450 B (+450 B within the step)" in text
    assert "3 allocations of this step live at the peak (450 B)" in text
    lines = text.splitlines()[1:]
    assert lines[0].split() == ["2", "x", "200", "B", "=", "400", "B", "c.py:7"]  # largest group first, our frame only
    assert lines[1].split() == ["1", "x", "50", "B", "=", "50", "B", "b.py:7"]
    assert len(lines) == 2


def test_live_blocks_grouped_by_size_and_call_site() -> None:
    from benchmarks.diagnostics.train_diagnostics import _live_blocks

    def block(size: int, state: str, where: str | None) -> dict:
        frames = [] if where is None else [{"filename": f"/r/moontrain/{where}.py", "line": 3, "name": "g"}]
        return {"size": size, "state": state, "frames": frames}

    snapshot = {"segments": [{"blocks": [block(512, "active_allocated", "p"), block(512, "inactive", "p"),
                                         block(4096, "active_allocated", None)]},
                             {"blocks": [block(512, "active_allocated", "p"), block(256, "active_pending_free", "q"),
                                         block(1024, "active_allocated", "q")]}]}
    lines = _live_blocks(snapshot).splitlines()
    assert lines[0] == "6,144 B in 4 blocks"
    assert [ln.split() for ln in lines[1:]] == [
        ["1", "x", "4,096", "B", "=", "4,096", "B", "(no", "python", "frame)"],
        ["2", "x", "512", "B", "=", "1,024", "B", "p.py:3"],
        ["1", "x", "1,024", "B", "=", "1,024", "B", "q.py:3"]]


def test_timeline_summary_busy_idle_and_classes() -> None:
    from benchmarks.diagnostics.train_diagnostics import _union_ns, kernel_class, kernel_table, timeline_summary

    assert _union_ns([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert kernel_class("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert kernel_class("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT") == "gemm"
    assert kernel_class("_scatter_kernel") == "moonep comm"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, mul>") == "elementwise / reduce"
    assert kernel_class("triton_red_fused__to_copy_exp_log_mul_0") == "inductor fused"  # not "copy / cast"
    assert kernel_class("triton_tem_fused_0") == "attention"  # flex_attention's template
    # in ms (x 1e6 ns): compute stream 7: gemm [0, 1) and [0.3, 0.5), gap, attention [1.5, 2), gap to the
    # step's end at 3 (stream 9: nccl [1, 1.4))
    ms = 1_000_000
    kernels = [(7, 10 * ms, 1 * ms, "sm90_xmma_gemm_bf16"), (7, 11_500_000, ms // 2, "flash_fwd_kernel"),
               (9, 11 * ms, 400_000, "ncclDevKernel_AllGather"), (7, 10_300_000, 200_000, "sm90_xmma_gemm_bf16"),
               (9, 12 * ms, 1 * ms, "ncclDevKernel_ReduceScatter")]
    lines = timeline_summary(kernels).splitlines()
    assert lines[0].startswith("timeline: span 3.00 ms")
    assert lines[1].split() == ["stream", "7:", "3", "1.50", "(", "50.0%)", "<-", "compute", "(busiest)"]
    assert lines[2].split() == ["stream", "9:", "2", "1.40", "(", "46.7%)"]
    assert next(x for x in lines if x.split()[0] == "gemm").split() == ["gemm", "2", "1.20", "(", "40.0%)"]
    assert next(x for x in lines if x.split()[0] == "attention").split() == ["attention", "1", "0.50", "(", "16.7%)"]
    # gaps on stream 7: [1, 1.5) and [2, 3); stream 9 covers 0.4 + 1.0 of them
    idle = next(x for x in lines if "idle" in x)
    assert "idle 1.50 ms in 2 gaps (50.0% of span), of which 1.40 ms with another stream busy" in idle
    # the gap [1, 1.5) ends at the attention kernel; the step's end closes no kernel's wait
    assert next(x for x in lines if "idle by the class" in x).endswith("(gaps, ms): attention 1 0.50")
    gaps = lines[lines.index("  longest gaps (ms: after -> before):") + 1:][:2]
    assert gaps[0].split() == ["1.000:", "flash_fwd_kernel", "->", "(end", "of", "step)"]
    assert gaps[1].split() == ["0.500:", "sm90_xmma_gemm_bf16", "->", "flash_fwd_kernel"]
    table = kernel_table(kernels).splitlines()  # every name, all streams, longest total first
    assert [x.split()[:3] for x in table[1:]] == [["2", "1.200", "gemm"], ["1", "1.000", "nccl"],
                                                 ["1", "0.500", "attention"], ["1", "0.400", "nccl"]]


def _host_profile_rank(rank: int, world: int, out: str) -> str:
    import argparse

    import torch
    import torch.distributed as dist

    from benchmarks.diagnostics.train_diagnostics import host_profile
    from moontrain.parallel.layout import build_layout
    from moontrain.trainer.trainer import Trainer
    from tests.moontrain.ckpt_utils import small_config

    torch.set_num_threads(1)
    layout = build_layout(world, torch.device("cpu"))
    trainer = Trainer(small_config("local", 1, run_dir=out), layout)
    try:
        text = host_profile(trainer, layout, argparse.Namespace(out=out), dist.group.WORLD, steps=2)
        return text if trainer.step == 2 else f"trained {trainer.step} steps"
    finally:
        trainer.close()


def test_host_profile_profiles_pipelined_steps(tmp_path) -> None:
    """--host-profile: two more steps as Trainer.fit runs them under cProfile; the file names the trainer's own
    functions (the pipelined steps) by self and cumulative time."""
    from tests.dist_utils import run_ranks

    [text] = run_ranks(_host_profile_rank, 1, str(tmp_path))
    assert text.startswith("2 pipelined steps under cProfile: ") and "by self time:" in text
    cumulative = text.split("by cumulative time:")[1]
    assert "(run_steps)" in cumulative and "(_train_step)" in cumulative
    written = (tmp_path / "host_profile_local_skew0.txt").read_text()
    assert written.startswith("===== rank 0\n2 pipelined steps under cProfile")
