"""GraphPlanner: the PyTorch planner replayed from a CUDA graph.

The planner's greedy loops are a fixed number of masked steps over tiny tensors (about 400
kernels at E = 96, R = 2), so run eagerly it is bound by kernel launches on the host (~15 ms
measured on H200, 2026-11-29, benchmarks/results/bench_comm_R2_pytorch_path.json). Its shapes
depend only on (s, total_num_tokens), and it never synchronises with the host, so it can be
captured once per shape and replayed: one launch from the host, the same kernels on the device,
bitwise the same plan (the graph runs exactly the eager code).

The first call for a new shape captures (a host synchronisation, like any compile step); later
calls copy the inputs into the graph's static tensors, replay, and clone the outputs, because a
plan outlives the next replay (it is saved for backward).
"""

from __future__ import annotations

import dataclasses

import torch

from moonep.layout import Layout
from moonep.planner import Plan, SharedPlanner, make_plan, plan_shared


class GraphPlanner:
    def __init__(self, layout: Layout, rank: int, shared: SharedPlanner = plan_shared) -> None:
        self.layout = layout
        self.rank = rank
        self.shared = shared
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, Plan]] = {}

    def __call__(self, topk_sK: torch.Tensor, counts_RE: torch.Tensor, total_num_tokens: int | None) -> Plan:
        key = (tuple(topk_sK.shape), topk_sK.dtype, counts_RE.dtype, total_num_tokens)
        if key not in self._graphs:
            self._graphs[key] = self._capture(topk_sK, counts_RE, total_num_tokens)
        graph, topk_in, counts_in, out = self._graphs[key]
        topk_in.copy_(topk_sK)
        counts_in.copy_(counts_RE)
        graph.replay()
        tensors = {f.name: getattr(out, f.name).clone() for f in dataclasses.fields(out)
                   if isinstance(getattr(out, f.name), torch.Tensor)}
        return dataclasses.replace(out, **tensors)

    def _capture(self, topk_sK: torch.Tensor, counts_RE: torch.Tensor, total: int | None) -> tuple:
        topk_in, counts_in = topk_sK.clone(), counts_RE.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy inits, workspace)
            make_plan(self.layout, self.rank, topk_in, counts_in, total_num_tokens=total, shared=self.shared)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads/streams of a training step (FSDP, NCCL) may keep working
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = make_plan(self.layout, self.rank, topk_in, counts_in, total_num_tokens=total, shared=self.shared)
        return graph, topk_in, counts_in, out
