"""The Triton kernels run on the CPU in Triton's interpreter, bitwise against the PyTorch path.

Skipped where triton is not installed (the `test` extra installs it). Bitwise: the
planner (integers: the fused planner of Buffer.plan, simulated for R = 1..8 in one process and run
by a 2-rank Buffer), the expert-side prefetch / reduce_grad / slot zeroing (copies and fp32 adds in a
fixed order), dispatch rows and weights, saved-plan dispatch, combine's scalar gather. Combine's
output is within one bf16 ulp: the interpreter truncates fp32 -> bf16 where the GPU rounds (on the
GPU tests/moonep/gpu/test_kernels.py checks it bitwise).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moonep import BufferConfig, BufferOptions
from moonep.layout import Layout
from moonep.planner import make_plan
from moonep.testing import assert_same_plan
from tests.dist_utils import run_ranks
from tests.moonep.planner_cases import (
    check_fused_cases,
    check_fused_topk,
    group_skewed_topk,
    planner_cases,
    random_topk,
)

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel; inherited by spawned ranks
_interpreter = pytest.importorskip("triton.runtime.interpreter")
_patch_lang_tensor = _interpreter._patch_lang_tensor


def _patch_lang_tensor_numpy2(tensor):
    """triton 3.5's interpreter turns a runtime scalar into an index with int() of a 1-element array,
    which numpy 2.4 rejects (a kernel loop `range(0, n)` with n a kernel argument fails); index
    through the array's single element instead. Test-only shim: the GPU never runs the interpreter."""
    _patch_lang_tensor(tensor)
    tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])


_interpreter._patch_lang_tensor = _patch_lang_tensor_numpy2
_create_histogram = _interpreter.InterpreterBuilder.create_histogram


def _create_histogram_int32(self, data, bins, mask):
    """triton 3.5's interpreter labels np.histogram's int64 counts int32, so arithmetic on them
    stores 8-byte elements into int32 memory; give them the int32 data the label promises."""
    out = _create_histogram(self, data, bins, mask)
    return _interpreter.TensorHandle(out.data.astype(np.int32), out.dtype)


_interpreter.InterpreterBuilder.create_histogram = _create_histogram_int32
_create_dot = _interpreter.InterpreterBuilder.create_dot


def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
    """triton 3.5's interpreter stores bf16 as its uint16 bits and multiplies those; give tl.dot the
    fp32 values (exact: a bf16 value is an fp32 value with its low 16 bits zero)."""
    def as_fp32(x):
        if x.dtype.scalar != _interpreter.tl.bfloat16:
            return x
        return _interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), _interpreter.tl.float32)

    return _create_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)


_interpreter.InterpreterBuilder.create_dot = _create_dot_bf16


def _combine_slices(op, left, right, dtypes):
    """The combine function of a reduce / scan applied to whole numpy slices at once: flattened and
    padded to a power of two (a block's shape), the padding's results dropped."""
    shape, size = left[0].shape, left[0].size
    padded = 1 << max(0, size - 1).bit_length()

    def block(x, t):
        return op.to_tensor(np.pad(x.reshape(-1), (0, padded - size), mode="edge"), t)

    out = op.combine_fn.fn(*(block(x, t) for x, t in zip(left, dtypes, strict=True)),
                           *(block(x, t) for x, t in zip(right, dtypes, strict=True)))
    return [o.handle.data[:size].reshape(shape) for o in (out if isinstance(out, tuple) else (out,))]


def _generic_reduce_vectorized(self, input):
    """triton 3.5's interpreter reduces with a custom combine function (a tuple reduction) in a
    Python loop over every element, seconds per planner program; combine adjacent pairs of whole
    slices instead, the earlier on the left (Triton's combine functions are associative)."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    while data[0].shape[0] > 1:
        n = data[0].shape[0] // 2 * 2
        pairs = _combine_slices(self, [d[0:n:2] for d in data], [d[1:n:2] for d in data], dtypes)
        data = [np.concatenate([p, d[n:]]) for p, d in zip(pairs, data, strict=True)]
    ret = []
    for d, t in zip(data, dtypes, strict=True):
        d = d[0]
        if self.keep_dims:
            d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * len(input[0].shape))
        elif original_axis is None:
            d = d.item()
        ret.append(self.to_tensor(d, t))
    return ret


def _generic_scan_vectorized(self, input):
    """An inclusive scan with a custom combine function as log2(n) steps on whole slices
    (Hillis-Steele: element i combines element i - 2**k on the left), not a loop per element."""
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, self.axis, 0) for arg in input]
    k = 1
    while k < data[0].shape[0]:
        new = _combine_slices(self, [d[:-k] for d in data], [d[k:] for d in data], dtypes)
        data = [np.concatenate([d[:k], x]) for d, x in zip(data, new, strict=True)]
        k *= 2
    return [self.to_tensor(np.moveaxis(d, 0, self.axis), t) for d, t in zip(data, dtypes, strict=True)]


_interpreter.ReduceOps.generic_reduce = _generic_reduce_vectorized
_interpreter.ScanOps.generic_scan = _generic_scan_vectorized

def test_fused_planner_matches_make_plan() -> None:
    g = torch.Generator().manual_seed(2)
    cases = [(R, E, K, [s] * R, B, pad, sigma, False)
             for R, E, K, s, B, pad, sigma in planner_cases(32, (1, 2, 4, 8), 6, ())]
    cases += [(R, E, K, [int(torch.randint(1, 2 * s + 1, (1,), generator=g)) for _ in range(R)], B, pad, sigma, True)
              for R, E, K, s, B, pad, sigma in planner_cases(16, (2, 4, 8), 6, (), seed=1)]
    # several chunks of 512 entries, K not a power of two, the benchmark's E
    cases += [(2, 384, 8, [512, 512], 192, 16, 3.0, False), (2, 384, 8, [700, 333], 96, 16, 1.0, True),
              (4, 64, 6, [400] * 4, 16, 4, 0.0, False), (2, 8, 1, [2100, 2100], 2, 2, 2.0, False),
              (8, 384, 8, [130] * 8, 48, 16, 3.0, False), (8, 112, 16, [64] * 8, 14, 16, 3.0, False)]
    check_fused_cases(cases, g)


def test_fused_planner_slots_run_out() -> None:
    """Routings on the lowest home groups only: every receiver takes many experts of similar size, so
    with few slots remote experts keep their home rows (docs/moonep.md §5.4), and a donor may become a receiver;
    the last two at K3's ratios (E / R = 14, K = 16, R = 8)."""
    g = torch.Generator().manual_seed(5)
    for R, E, K, s, groups, B, pad in ((2, 16, 4, 40, 1, 2, 4), (8, 112, 16, 48, 3, 3, 16), (8, 112, 16, 64, 3, 14, 1)):
        epn = E // R
        topk_R = [group_skewed_topk(s, E, K, groups, epn, g) for _ in range(R)]
        check_fused_topk(topk_R, E, B, pad, False, f"{groups} donor groups")
        counts = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E) for t in topk_R]).to(torch.int32)
        plan = make_plan(Layout(BufferConfig(max_tokens=s, hidden=8, topk=K, num_experts=E, token_padding=pad,
                                             num_slots=B), R, 4096), 0, topk_R[0], counts)
        home_rows_R = plan.group_rows_RG[:, :E].view(R, R, epn).sum(2)  # [rank, home group]
        remote_home_rows = int(home_rows_R.sum() - home_rows_R.diagonal().sum())
        assert (remote_home_rows > 0) == (B < epn), f"B={B}: {remote_home_rows} remote rows on home rows"


@pytest.mark.parametrize("chunk", [32, 256, 1024])
def test_fused_planner_other_chunk_sizes(chunk: int) -> None:
    """The chunk size is a tuning knob (benchmarks/bench_planner.py): many chunks per expert run, runs
    crossing chunk ends, a last partial chunk, K not a power of two, K3's K = 16 and E / R = 14 at
    R = 8."""
    g = torch.Generator().manual_seed(4)
    cases = [(2, 384, 8, [512, 512], 192, 16, 3.0, False), (2, 384, 8, [700, 333], 96, 16, 1.0, True),
             (4, 16, 3, [37] * 4, 4, 2, 2.0, False), (8, 64, 8, [64] * 8, 8, 4, 0.5, False),
             (8, 112, 16, [40] * 8, 14, 16, 3.0, False)]
    check_fused_cases(cases, g, chunk=chunk)


def test_fused_chunk_kernel_matches_reference() -> None:
    """The chunk pass's kernel alone against a one-hot reference: per-chunk histograms and each
    entry's rank among the chunk's entries of its expert; E a power of two (the padding id E needs
    one more bit), E = 1 (one run through every chunk), K not a power of two, a last partial chunk."""
    from moonep.planner import fused as pf

    g = torch.Generator().manual_seed(7)
    for E, K, s, chunk in ((512, 16, 70, 64), (1, 1, 100, 32), (96, 6, 45, 64), (896, 16, 40, 512)):
        topk = random_topk(s, E, K, 2.0, g)
        layout = Layout(BufferConfig(max_tokens=s, hidden=8, topk=K, num_experts=E), 1, 4096)
        work = pf._Workspace(layout, s, torch.device("cpu"), chunk)
        work.chunk_hist.fill_(-7), work.rank_in_chunk.fill_(-7)  # garbage: the kernel writes every element
        pf.count_step(topk, E, work)
        flat = torch.nn.functional.pad(topk.reshape(-1).long(), (0, work.num_chunks * chunk - s * K), value=E)
        onehot = torch.nn.functional.one_hot(flat.view(-1, chunk), E + 1)  # [chunks, chunk, E + 1]
        want_rank = ((onehot.cumsum(1) - onehot) * onehot).sum(2).view(-1)[: s * K]
        context = f"E={E} K={K} s={s} chunk={chunk}"
        assert torch.equal(work.chunk_hist, onehot.sum(1)[:, :E].int()), f"{context}: chunk histograms"
        bad = (work.rank_in_chunk != want_rank).nonzero()
        assert bad.numel() == 0, f"{context}: rank of entry {bad[0].item()} is {work.rank_in_chunk[bad[0]].item()}"


def test_fused_workspace_rejects_bad_knobs() -> None:
    from moonep.planner import fused as pf

    layout = Layout(BufferConfig(max_tokens=8, hidden=8, topk=2, num_experts=4), 1, 4096)
    for chunk in (16, 96):
        with pytest.raises(ValueError, match=f"chunk={chunk}: .* pass a power of two >= 32"):
            pf._Workspace(layout, 8, torch.device("cpu"), chunk)


def test_fused_planner_int64_keys() -> None:
    """A layout whose max_tokens puts R * max_tokens * K past the int32 argmax keys of the shared
    kernel: the int64 keys plan the same as make_plan."""
    from moonep.planner import fused as pf

    g = torch.Generator().manual_seed(8)
    R, E, K, s = 4, 32, 4, 50
    big = Layout(BufferConfig(max_tokens=2**24, hidden=8, topk=K, num_experts=E), R, 4096)
    small = Layout(BufferConfig(max_tokens=s, hidden=8, topk=K, num_experts=E), R, 4096)
    assert pf._key64(big) and not pf._key64(small)
    for sigma in (0.0, 3.0):
        topk_R = [random_topk(s, E, K, sigma, g) for _ in range(R)]
        check_fused_topk(topk_R, E, E // R, 4, False, f"int64 keys, sigma={sigma}", max_tokens=2**24)


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


BF16_ULP = 2.0**-7  # relative spacing of bf16


def _dispatch_kernels_rank(rank: int, world: int, scatter_tile: int) -> tuple[list[int], list[tuple[int, int]]]:
    import moonep.buffer as buffer_module
    from moonep import Buffer, BufferConfig
    from moonep.routing import generate_routing

    S, H, K, E = 40, 80, 4, 8 * world
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4,
                       options=BufferOptions(num_sms=3, scatter_tile=scatter_tile))
    ref = Buffer(cfg)
    # the triton path is CUDA-only by design; force it onto the CPU heap for the interpreter
    buffer_module.resolve_kernels = lambda kernels, device: "triton"
    fast = Buffer(cfg)
    try:
        assert fast.kernel_path == "triton" and ref.kernel_path == "torch"
        g = torch.Generator().manual_seed(100 + rank)
        used, dups = [], []
        for maxvio, s in ((0.0, S), (1.0, 37), (2.9, S)):
            routing = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K,
                                       target_maxvio=maxvio, seed=5)
            topk, hist = routing.for_rank(rank)
            x = torch.randn(s, H, generator=g).to(torch.bfloat16)
            w = torch.rand(s, K, generator=g)
            grad = torch.randn(s, H, generator=g).to(torch.bfloat16)
            topk2, hist2 = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K,
                                            target_maxvio=1.5, seed=6).for_rank(rank)
            outs = []
            for buf in (ref, fast):
                res = buf.dispatch(x, w, topk, hist)
                out = {"rows": res.x_rows.clone(), "weights": res.weights_rows.clone()}
                out["saved_rows"] = buf.dispatch(grad, plan=res.plan).x_rows.clone()
                y_rows = torch.randn(res.plan.nvs_s, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
                scal = torch.randn(res.plan.nvs_s, generator=torch.Generator().manual_seed(8))
                out["y"], out["scalars"] = buf.combine(res.plan, y_rows, row_scalars=scal)
                # combine with a plan that is not the last dispatched one: the row_src refresh path
                # (scatter with rows=False, expand without copies)
                out["rows_other"] = buf.dispatch(x, w, topk2, hist2).x_rows.clone()
                out["y_stale_plan"] = buf.combine(res.plan, y_rows)[0]
                outs.append(out)
                used.append(int((res.plan.slot_expert_RB >= 0).sum()))
            # duplicates on this rank (stored by its scatter) and on the peer (copied by the peer's expand)
            p = res.plan
            dup = p.copy_row_sK != p.dst_row_sK
            dups.append((int((dup & (p.dst_rank_sK == rank)).sum()), int((dup & (p.dst_rank_sK != rank)).sum())))
            want, got = outs
            for key in ("rows", "weights", "saved_rows", "scalars", "rows_other"):
                assert torch.equal(got[key], want[key]), f"{key} differs at maxvio {maxvio}"
            # the interpreter casts fp32 -> bf16 by truncation, the GPU (and torch) by rounding
            for key in ("y", "y_stale_plan"):
                err = (got[key].float() - want[key].float()).abs()
                assert bool((err <= BF16_ULP * want[key].float().abs()).all()), f"{key} off by > 1 ulp ({err.max()})"
            # the scatter's block counter and exit counter are back to zero after every launch
            assert fast.path._scatter_work.tolist() == [0, 0], fast.path._scatter_work
        return used, dups
    finally:
        fast.destroy()
        ref.destroy()


@pytest.mark.parametrize("scatter_tile", [16384, 256])
def test_dispatch_combine_kernels_match_pytorch_path(scatter_tile: int) -> None:
    """The default tile; a 256-element tile (2 tokens per block) makes each program loop."""
    (used, dups0), (_, dups1) = run_ranks(_dispatch_kernels_rank, 2, scatter_tile, timeout_s=300)
    assert any(n > 0 for n in used), f"some routing should occupy slots: {used}"
    dups = dups0 + dups1  # (on the own rank, on the peer) per rank and case
    assert all(own > 0 and peer > 0 for own, peer in dups), f"need duplicates on the own rank and the peer: {dups}"


def _fused_plan_rank(rank: int, world: int) -> list[int]:
    import moonep.buffer as buffer_module
    from moonep import Buffer
    from moonep.routing import generate_routing

    S, K, E = 300, 6, 12 * world
    cfg = BufferConfig(max_tokens=S, hidden=16, topk=K, num_experts=E, token_padding=4, num_slots=5,
                       options=BufferOptions(num_sms=3))
    # the triton path is CUDA-only by design; force it onto the CPU heap for the interpreter
    buffer_module.resolve_kernels = lambda kernels, device: "triton"
    buf = Buffer(cfg)
    try:
        assert buf.kernel_path == "triton"
        used = []
        for maxvio, s_R, pass_hist in ((0.3, (S, S), True), (3.0, (S, S), False), (2.0, (S, 171), True)):
            routing = generate_routing(num_ranks=world, tokens_per_rank=S, num_experts=E, topk=K,
                                       target_maxvio=maxvio, seed=11)
            topk_R = [routing.topk_RsK[r][: s_R[r]].contiguous() for r in range(world)]
            counts = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E) for t in topk_R]).to(torch.int32)
            total = sum(s_R) if s_R[0] != s_R[1] else None
            hist = counts[rank] if pass_hist else None
            for _ in range(2):  # a second call reuses the workspace (the ticket is back at 0)
                plan = buf.plan(topk_R[rank], hist, total_num_tokens=total)
                buf.barrier("test:planned")  # plan() twice in a row needs a barrier between (hist region)
                want = make_plan(buf.layout, rank, topk_R[rank], counts, total_num_tokens=total)
                assert_same_plan(plan, want, f"rank {rank} maxvio {maxvio} s={s_R}")
            used.append(int((plan.slot_expert_RB >= 0).sum()))
        return used
    finally:
        buf.destroy()


def test_fused_planner_in_buffer_matches_make_plan() -> None:
    used = run_ranks(_fused_plan_rank, 2, timeout_s=300)
    assert any(n > 0 for n in used[0]), f"some routing should occupy slots: {used}"

