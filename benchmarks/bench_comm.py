"""moonep vs the all-to-all baseline: communication per op over routing skew (docs/moonep.md §9).

    torchrun --nproc_per_node=2 benchmarks/bench_comm.py --experts 96 384 --maxvio 0 0.2 1 10 20
    torchrun --nproc_per_node=2 benchmarks/bench_comm.py --shapes k3 --maxvio 0 0.2 1 10

--shapes picks a preset of (experts, topk, hidden, ffn, pools); explicit flags override it:
    default  E = 96 and 384, K = 8,  H = 7168, F = 2048, with ExpertPools
    k3       E = 896,        K = 16, H = 7168, F = 3072 (recipes/k3.yaml; K3's latent MoE dispatches
             at 3584: add --hidden 3584), without ExpertPools: one layer's expert weights, grads,
             slots and reduce pools at E = 896 would take ~330 GiB per rank at R = 2, so prefetch,
             reduce_grad and dispatch + prefetch are not measured (--pools forces them).

Per (E, target maxvio) point and backend: median over --iters timed iterations (CUDA events,
after warm-up; ranks aligned before each op), max over ranks. moonep ops: plan; dispatch fwd
(planning + dispatch + prefetch), dispatch alone (planning included), dispatch with the saved plan
(no planning: the data-path kernels alone), prefetch alone; combine fwd; dispatch bwd (a combine with the
saved plan, route-weight grads gathered); combine bwd (a dispatch with the saved plan);
reduce_grad. Baseline: torchtitan-style all-to-all (count exchange, host split sizes, NCCL
all_to_all_single, permute), forward and backward. Also reported: realised expert maxvio,
rank-level max/mean received rows, logical GB/s = s*K*H*2/t, bytes that crossed NVLink, peak
memory, and the shapes moonep returned (identical across points for a fixed s).
--placement concentrated renumbers the experts by popularity so the hot ones share home rank 0 (the
case bench_train uses). --kernels picks the moonep data path (BufferOptions.kernels: torch, triton or auto), --num-sms the
grid of its persistent kernels. --combine-reduce runs every point once per BufferOptions.combine_reduce
value ("source", "destination": a token's rows summed per destination rank before they travel); its
extra ops are the combines as moonep.expert_glu issues them: forward with the route-weight scale
(source: scale_rows into combine_input, then combine; destination: combine with row_weights) and
backward with the route weights' grads (the gate|up GEMM's one input gradient: combine with row_scalars).
Writes benchmarks/results/bench_comm_R<R>_<tag>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.alltoall_baseline import AllToAllDispatcher
from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools
from moonep.routing import generate_routing, max_maxvio

# ~1 ms of GPU sleep queued before the start event when `hide_host` is on: the host enqueues fn
# meanwhile, so the events time the GPU work alone (as inside a training step, where the host runs ahead)
_HOST_HIDING_CYCLES = 2_000_000
_PLAN_RUN = 8


def timed(fn: Callable[[], object], iters: int, warmup: int, group: dist.ProcessGroup,
          setup: Callable[[], object] | None = None, hide_host: bool = False,
          align: Callable[[], object] | None = None) -> float:
    """Median microseconds of fn over iters (ranks aligned before each; `setup` runs untimed before
    each), max over ranks. By default the time includes the host's launch overhead (the GPU idles
    until fn's work arrives); hide_host times the GPU work alone. `align` (a GPU barrier) is queued
    right before the start event, after the host-hiding sleep: the ranks' GPUs then start fn together,
    as they do inside a step, where fn follows other barriers; without it a rank whose host ran
    ahead would count the other host's lag in fn's first wait."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_host:
            torch.cuda._sleep(_HOST_HIDING_CYCLES)
        if align is not None:
            align()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    med = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return float(med)


def peer_copy_GBps(buf: Buffer, x: torch.Tensor, iters: int, warmup: int, group: dist.ProcessGroup) -> float:
    """Peer-copy bandwidth of this machine in this run: x (this rank's S x H tokens) copied into the
    next rank's receive rows through the symmetric mapping by the copy engine (every rank at once,
    from a common start), GPU time (host launch hidden), median GB/s, min over ranks. The reference
    for dispatch's NVLink throughput."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    if R == 1:
        return float("nan")
    peer_rows = buf._all["recv"][(rank + 1) % R][: x.shape[0]]
    # GPU time from a common start, as the scatter phase's: both directions of the link busy at once
    us = timed(lambda: peer_rows.copy_(x), iters, warmup, group, hide_host=True,
               align=lambda: buf.barrier("bench:peer_copy"))
    buf.barrier("bench:peer_copy")
    gbps = torch.tensor(x.numel() * x.element_size() / (us * 1e-6) / 1e9, device="cuda")
    dist.all_reduce(gbps, op=dist.ReduceOp.MIN, group=group)
    return float(gbps)


def max_over_ranks(x: float, group: dist.ProcessGroup) -> float:
    t = torch.tensor(float(x), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def bench_point(args: argparse.Namespace, E: int, target: float, buf: Buffer, pools: ExpertPools | None, layer,
                a2a: AllToAllDispatcher, group: dist.ProcessGroup) -> dict:
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    S, H, K = args.tokens, args.hidden, args.topk
    reach = max_maxvio(E, K)
    eff_target = min(target, 0.97 * reach)
    routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=eff_target,
                               seed=args.seed)
    topk_RsK, hist_RE = routing.topk_RsK, routing.tokens_per_expert_RE
    if args.placement == "concentrated":  # renumber by popularity: the hot experts share home rank 0
        new_id = torch.empty(E, dtype=torch.long)
        new_id[torch.argsort(hist_RE.sum(0), descending=True, stable=True)] = torch.arange(E)
        topk_RsK = new_id[topk_RsK.long()].to(topk_RsK.dtype)
        hist_RE = torch.zeros_like(hist_RE).index_copy_(1, new_id, hist_RE)
    topk = topk_RsK[rank].cuda()
    hist = hist_RE[rank].cuda()
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    x = torch.randn(S, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.rand(S, K, device="cuda", generator=gen)
    grad_y = torch.randn(S, H, device="cuda", generator=gen).to(torch.bfloat16)
    it, wu = args.iters, args.warmup
    out: dict = {"E": E, "target_maxvio": target, "routed_target": eff_target,
                 "realised_maxvio": routing.realised_maxvio, "sigma": routing.sigma}

    # ---------------- moonep
    torch.cuda.reset_peak_memory_stats()
    res = buf.dispatch(x, w, topk, hist)
    plan = res.plan
    shapes = {"x_rows": list(res.x_rows.shape), "weights_rows": list(res.weights_rows.shape),
              "cu_seqlens": list(res.cu_seqlens.shape)}
    y_rows = buf.combine_input(plan)
    y_rows.copy_(torch.randn_like(y_rows, dtype=torch.float32).to(torch.bfloat16))
    grad_rows = torch.randn(plan.nvs_s, H, device="cuda").to(torch.bfloat16)
    grad_scal = torch.randn(plan.nvs_s, device="cuda")
    m = {}
    # plan() after plan() adds a "plan:enter" barrier (histogram safety); in a step a plan always
    # follows other calls, so each timed plan() comes after an untimed buffer barrier
    m["plan"] = timed(lambda: buf.plan(topk, hist), it, wu, group, setup=lambda: buf.barrier("bench:plan"))
    # GPU time per plan in a run of 8 back-to-back plans (host hidden): one call alone also waits for
    # the skew between the ranks' hosts at its barrier, which the run spreads over 8 calls
    m["plan_gpu"] = timed(lambda: [buf.plan(topk, hist) for _ in range(_PLAN_RUN)], it, wu, group,
                          setup=lambda: buf.barrier("bench:plan"), hide_host=True) / _PLAN_RUN
    if pools is not None:
        m["dispatch_fwd"] = timed(lambda: pools.prefetch(buf.dispatch(x, w, topk, hist).plan, layer), it, wu, group)
    m["dispatch_only"] = timed(lambda: buf.dispatch(x, w, topk, hist), it, wu, group)
    m["dispatch_saved"] = timed(lambda: buf.dispatch(x, w, plan=plan), it, wu, group)
    # the phase in which dispatch's bytes cross NVLink: the sender's scatter and the barrier that
    # completes it (the receiver's local duplicate expansion follows); GPU time from a common start
    # (in dispatch the scatter follows the planner's barriers), for the NVLink rate
    enter = lambda: buf.barrier("dispatch:enter")
    m["dispatch_scatter"] = timed(lambda: (buf.path.scatter(plan, x, w), buf.barrier("dispatch:rows")), it, wu, group,
                                  hide_host=True, align=enter)
    # its parts, same conditions: the scatter kernel alone (its last stores may still be in flight at
    # the end event), the metadata alone (rows=False: row_src per entry, + barrier), the barrier alone
    m["scatter_kernel"] = timed(lambda: buf.path.scatter(plan, x, w), it, wu, group, hide_host=True, align=enter)
    if buf.kernel_path == "triton":  # the metadata-only scatter is the triton path's (combine's refresh)
        m["scatter_meta"] = timed(lambda: (buf.path.scatter(plan, x, w, rows=False), buf.barrier("dispatch:rows")),
                                  it, wu, group, hide_host=True, align=enter)
    m["scatter_barrier"] = timed(lambda: buf.barrier("dispatch:rows"), it, wu, group, hide_host=True, align=enter)
    if pools is not None:
        m["prefetch"] = timed(lambda: pools.prefetch(plan, layer), it, wu, group)
    m["combine_fwd"] = timed(lambda: buf.combine(plan, y_rows), it, wu, group)
    m["dispatch_bwd"] = timed(lambda: buf.combine(plan, grad_rows, row_scalars=grad_scal), it, wu, group)
    # the combines as moonep.expert_glu issues them: forward with the route-weight scale; backward the input
    # gradient of the one gate|up GEMM with the route weights' grads (inputs reuse grad_rows and the
    # combine_input rows: no extra memory in the point's peak)
    o_rows, w_rows = grad_rows, res.weights_rows.clone()
    if buf.config.options.combine_reduce == "destination":
        m["combine_layer_fwd"] = timed(lambda: buf.combine(plan, o_rows, row_weights=w_rows), it, wu, group)
    else:
        m["combine_layer_fwd"] = timed(lambda: (buf.path.scale_rows(o_rows, w_rows, y_rows), buf.combine(plan, y_rows)),
                                       it, wu, group)
    m["combine_layer_bwd"] = timed(lambda: buf.combine(plan, grad_rows, row_scalars=grad_scal), it, wu, group)
    m["combine_bwd"] = timed(lambda: buf.dispatch(grad_y, plan=plan), it, wu, group)
    if pools is not None:
        m["reduce_grad"] = timed(lambda: pools.reduce_grad(plan, layer), it, wu, group)
    y_sH, _ = buf.combine(plan, y_rows)
    shapes["y_sH"] = list(y_sH.shape)
    remote = (plan.dst_rank_sK != rank) & plan.sent_sK
    sent_bytes = int(remote.sum()) * H * 2
    # combine sends every remote entry's row ("source") or one row per token and remote rank ("destination")
    back = remote if buf.config.options.combine_reduce == "destination" else plan.dst_rank_sK != rank
    combine_bytes = int(back.sum()) * H * 2
    peer_bw = peer_copy_GBps(buf, x, it, wu, group)
    rows_R = plan.alloc_ER.sum(0).float()
    slot_copies = int((plan.slot_expert_RB >= 0).sum())
    moonep_out = {f"{k}_us": v for k, v in m.items()}
    moonep_out.update(
        rank_load_max_over_mean=float(rows_R.max() / rows_R.mean()),
        nvlink_dispatch_bytes=max_over_ranks(sent_bytes, group),
        nvlink_combine_bytes=max_over_ranks(combine_bytes, group),
        dispatch_logical_GBps=S * K * H * 2 / (m["dispatch_only"] * 1e-6) / 1e9,
        combine_logical_GBps=S * K * H * 2 / (m["combine_fwd"] * 1e-6) / 1e9,
        dispatch_nvlink_GBps=max_over_ranks(sent_bytes, group) / (m["dispatch_only"] * 1e-6) / 1e9,
        dispatch_saved_nvlink_GBps=max_over_ranks(sent_bytes, group) / (m["dispatch_saved"] * 1e-6) / 1e9,
        scatter_nvlink_GBps=max_over_ranks(sent_bytes, group) / (m["dispatch_scatter"] * 1e-6) / 1e9,
        peer_copy_GBps=peer_bw,
        expert_copies=slot_copies,
        prefetch_bytes_per_rank=max_over_ranks(int(pools.prefetch_bytes(plan)), group) if pools is not None else float("nan"),
        peak_allocated_bytes=max_over_ranks(torch.cuda.max_memory_allocated(), group),
        symmetric_heap_bytes=buf.heap.local_bytes,
        shapes=shapes,
    )
    out["moonep"] = moonep_out

    # ---------------- all-to-all baseline
    torch.cuda.reset_peak_memory_stats()
    rows, st = a2a.dispatch(x, topk)
    y_m = torch.randn_like(rows, dtype=torch.float32).to(torch.bfloat16)
    b = {}
    b["dispatch_fwd"] = timed(lambda: a2a.dispatch(x, topk), it, wu, group)
    b["combine_fwd"] = timed(lambda: a2a.combine(st, y_m, w), it, wu, group)
    b["dispatch_bwd"] = timed(lambda: a2a.dispatch_backward(st, y_m), it, wu, group)
    b["combine_bwd"] = timed(lambda: a2a.combine_backward(st, grad_y), it, wu, group)
    recv = torch.tensor(sum(st.recv_splits), device="cuda", dtype=torch.float64)
    recv_all = [torch.zeros_like(recv) for _ in range(R)]
    dist.all_gather(recv_all, recv, group=group)
    recv_all = torch.stack(recv_all)
    a2a_remote = sum(n for r, n in enumerate(st.send_splits) if r != rank) * H * 2
    base_out = {f"{k}_us": v for k, v in b.items()}
    base_out.update(
        rank_load_max_over_mean=float(recv_all.max() / recv_all.mean()),
        received_rows_per_rank=recv_all.tolist(),
        nvlink_dispatch_bytes=max_over_ranks(a2a_remote, group),
        dispatch_logical_GBps=S * K * H * 2 / (b["dispatch_fwd"] * 1e-6) / 1e9,
        combine_logical_GBps=S * K * H * 2 / (b["combine_fwd"] * 1e-6) / 1e9,
        peak_allocated_bytes=max_over_ranks(torch.cuda.max_memory_allocated(), group),
    )
    out["alltoall"] = base_out
    return out


SHAPES = {  # --shapes presets: (experts, topk, hidden, ffn, pools)
    "default": {"experts": [96, 384], "topk": 8, "hidden": 7168, "ffn": 2048, "pools": True},
    "k3": {"experts": [896], "topk": 16, "hidden": 7168, "ffn": 3072, "pools": False},
}


def resolve_shapes(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from the --shapes preset."""
    for name, value in SHAPES[args.shapes].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def projections(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    return {"gate_up": (args.hidden, 2 * args.ffn), "down": (args.ffn, args.hidden)}


def rank_bytes(args: argparse.Namespace, E: int, R: int) -> dict[str, int]:
    """Per-rank bytes of one point: the Buffer's symmetric memory, and ExpertPools' one layer
    (bf16 weights + fp32 grads of the epn local experts, bf16 slots + fp32 reduce pool of B slots)."""
    from moonep.layout import Layout

    layout = Layout(BufferConfig(max_tokens=args.tokens, hidden=args.hidden, topk=args.topk, num_experts=E), R)
    per_expert = sum(i * o for i, o in projections(args).values())
    return {"buffer": layout.comm_bytes, "pools": (layout.epn + layout.num_slots) * per_expert * (2 + 4)}


def print_plan(args: argparse.Namespace) -> None:
    num_ranks = int(os.environ.get("WORLD_SIZE", "2"))
    for E in args.experts:
        b = rank_bytes(args, E, num_ranks)
        print(f"E={E} K={args.topk} H={args.hidden} F={args.ffn} s={args.tokens} R={num_ranks}: maxvio {args.maxvio}; "
              f"per rank: buffer {b['buffer'] / 2**30:.1f} GiB, ExpertPools {b['pools'] / 2**30:.1f} GiB "
              f"({'on' if args.pools else 'off'})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="default", choices=sorted(SHAPES), help="preset of the flags below")
    p.add_argument("--experts", type=int, nargs="+", default=None)
    p.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 0.2, 1.0, 10.0, 20.0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--pools", action=argparse.BooleanOptionalAction, default=None,
                   help="ExpertPools for prefetch / reduce_grad (one layer's expert weights and grads)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placement", default="random", choices=["random", "concentrated"],
                   help="expert numbering: the generator's (random) or by popularity (hot experts on rank 0)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file tag (default: the --kernels value and the date)")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                   help="moonep data path (BufferOptions.kernels)")
    p.add_argument("--num-sms", type=int, default=None, help="grid of moonep's persistent kernels (None: all SMs)")
    p.add_argument("--scatter-tile", type=int, default=BufferOptions().scatter_tile,
                   help="BufferOptions.scatter_tile: elements per scatter tile, a power of two")
    p.add_argument("--combine-reduce", nargs="+", default=["source"], choices=["source", "destination"],
                   help="BufferOptions.combine_reduce values; each point runs once per value")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved result and exit (no GPU needed)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the points and each rank's memory for them, and exit (no GPU needed)")
    args = resolve_shapes(p.parse_args(argv))
    if args.show:
        print_table(json.loads(Path(args.show).read_text())["points"])
        return
    if args.dry_run:
        print_plan(args)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    rank, R = dist.get_rank(), dist.get_world_size()
    results = []
    for E, reduce in [(E, reduce) for E in args.experts for reduce in args.combine_reduce]:
        cfg = BufferConfig(max_tokens=args.tokens, hidden=args.hidden, topk=args.topk, num_experts=E,
                           options=BufferOptions(check_values=False, timeout_s=60.0, kernels=args.kernels,
                                                 num_sms=args.num_sms, scatter_tile=args.scatter_tile,
                                                 combine_reduce=reduce))
        buf = Buffer(cfg, group)
        pools, layer = None, None
        if args.pools:
            pools = ExpertPools(buf, projections(args))
            layer = pools.add_layer()
            for w in layer.w_local.values():
                w.copy_(torch.randn(w.shape, device="cuda").to(w.dtype))
        a2a = AllToAllDispatcher(group, E)
        for target in args.maxvio:
            t0 = time.time()
            point = bench_point(args, E, target, buf, pools, layer, a2a, group)
            point["combine_reduce"] = reduce
            results.append(point)
            if rank == 0:
                mo, ba = point["moonep"], point["alltoall"]
                print(f"E={E} {reduce} maxvio {target} (realised {point['realised_maxvio']:.2f}): moonep dispatch "
                      f"{mo.get('dispatch_fwd_us', mo['dispatch_only_us']):.0f} us combine {mo['combine_fwd_us']:.0f} us | a2a dispatch "
                      f"{ba['dispatch_fwd_us']:.0f} us combine {ba['combine_fwd_us']:.0f} us [{time.time() - t0:.0f} s]",
                      flush=True)
        buf.destroy()
        torch.cuda.empty_cache()
    if rank == 0:
        print_table(results)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or f"{args.kernels}_{time.strftime('%Y%m%d')}"
        path = out / f"bench_comm_R{R}_{tag}.json"
        meta = {"R": R, "S": args.tokens, "placement": args.placement, "shapes": args.shapes, "H": args.hidden,
                "K": args.topk, "ffn": args.ffn, "pools": args.pools, "iters": args.iters,
                "kernels": args.kernels, "num_sms": args.num_sms, "scatter_tile": args.scatter_tile,
                "combine_reduce": args.combine_reduce,
                "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        path.write_text(json.dumps({"config": meta, "points": results}, indent=1))
        print(f"wrote {path}")
    dist.destroy_process_group()


def print_table(results: list[dict]) -> None:
    hdr = (f"{'E':>4} {'target':>6} {'real':>6} | {'plan':>6} {'p.gpu':>5} {'disp+pf':>8} {'disp':>7} {'d.saved':>7} {'pf':>6} {'cp':>3} "
           f"{'comb':>7} {'d.bwd':>7} {'c.bwd':>7} {'rgrad':>7} {'load':>5} {'nvl GB/s':>8} {'scat':>5} {'nvl.sc':>6} {'peer':>5} | {'a2a d':>7} "
           f"{'a2a c':>7} {'a2a db':>7} {'a2a cb':>7} {'load':>5}")
    print("times in us (median, max over ranks); d.saved = dispatch with the saved plan (no planning); cp = expert "
          "copies (slots used, all ranks); load = max/mean rows received per rank; nvl GB/s = bytes that crossed "
          "NVLink in dispatch / d.saved; p.gpu = plan's GPU time (host launch hidden, per plan of 8 back to back); scat = the scatter phase of "
          "dispatch (GPU time; its bytes cross NVLink, duplicate expansion follows); nvl.sc = NVLink bytes / scat; "
          "peer = peer-copy GB/s (copy engine) measured in the same run")
    print(hdr)
    nan = float("nan")
    for r in results:
        m, b = r["moonep"], r["alltoall"]
        print(f"{r['E']:>4} {r['target_maxvio']:>6.1f} {r['realised_maxvio']:>6.2f} | {m['plan_us']:>6.0f} "
              f"{m.get('plan_gpu_us', nan):>5.0f} "
              f"{m.get('dispatch_fwd_us', nan):>8.0f} {m['dispatch_only_us']:>7.0f} {m.get('dispatch_saved_us', nan):>7.0f} "
              f"{m.get('prefetch_us', nan):>6.0f} {m.get('expert_copies', -1):>3} "
              f"{m['combine_fwd_us']:>7.0f} {m['dispatch_bwd_us']:>7.0f} {m['combine_bwd_us']:>7.0f} "
              f"{m.get('reduce_grad_us', nan):>7.0f} {m['rank_load_max_over_mean']:>5.2f} "
              f"{m.get('dispatch_saved_nvlink_GBps', nan):>8.0f} {m.get('dispatch_scatter_us', nan):>5.0f} "
              f"{m.get('scatter_nvlink_GBps', nan):>6.0f} {m.get('peer_copy_GBps', nan):>5.0f} | "
              f"{b['dispatch_fwd_us']:>7.0f} {b['combine_fwd_us']:>7.0f} {b['dispatch_bwd_us']:>7.0f} "
              f"{b['combine_bwd_us']:>7.0f} {b['rank_load_max_over_mean']:>5.2f}")
    if any("scatter_kernel_us" in r["moonep"] for r in results):
        print("scatter phase parts (us, GPU time from a common start): scat = kernel + closing barrier; kernel "
              "alone; meta = metadata only (row_src per entry) + barrier; barrier alone; NVLink MB")
        for r in results:
            m = r["moonep"]
            print(f"{r['E']:>4} {r['target_maxvio']:>6.1f} | scat {m['dispatch_scatter_us']:>5.0f} kernel "
                  f"{m['scatter_kernel_us']:>5.0f} meta {m.get('scatter_meta_us', nan):>5.0f} barrier {m['scatter_barrier_us']:>5.0f} "
                  f"| {m['nvlink_dispatch_bytes'] / 1e6:6.1f} MB")
    if any("combine_layer_fwd_us" in r["moonep"] for r in results):
        print("combine per BufferOptions.combine_reduce (us): comb = plain combine; layer fwd = with the route-weight "
              "scale, layer bwd = with the dgrad halves and the route-weight grads, as moonep.expert_glu issues "
              "them; NVLink MB = combine rows that crossed to a peer")
        for r in results:
            m = r["moonep"]
            print(f"{r['E']:>4} {r['target_maxvio']:>6.1f} {r.get('combine_reduce', 'source'):>11} | comb "
                  f"{m['combine_fwd_us']:>7.0f} layer fwd {m['combine_layer_fwd_us']:>7.0f} layer bwd "
                  f"{m['combine_layer_bwd_us']:>7.0f} | {m['nvlink_combine_bytes'] / 1e6:6.1f} MB")
    for E in sorted({r["E"] for r in results}):
        pts = [r for r in results if r["E"] == E]
        shapes = {json.dumps(r["moonep"]["shapes"]) for r in pts}
        peaks = sorted({round(r["moonep"]["peak_allocated_bytes"] / 2**30, 3) for r in pts})
        heap = pts[0]["moonep"]["symmetric_heap_bytes"] / 2**30
        print(f"E={E}: moonep shapes identical across {len(pts)} points: {len(shapes) == 1} {shapes.pop()}; "
              f"peak allocated GiB {peaks} + symmetric heap {heap:.2f} GiB; a2a peak GiB "
              f"{sorted({round(r['alltoall']['peak_allocated_bytes'] / 2**30, 3) for r in pts})}")


if __name__ == "__main__":
    main()
