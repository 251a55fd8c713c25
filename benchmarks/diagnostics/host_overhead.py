"""The host work of one training step, measured on the CPU: a proxy for the K3 step's launch overhead.

    python benchmarks/diagnostics/host_overhead.py                  # k3_small's layer structure, tiny widths
    python benchmarks/diagnostics/host_overhead.py --out host.json --steps 3 experts.backend=local
    python benchmarks/diagnostics/host_overhead.py --show host.json # the table of a written JSON
    python benchmarks/diagnostics/host_overhead.py parallel.dense=plain  # dense params without FSDP
    python benchmarks/diagnostics/host_overhead.py --op add         # where one aten op runs, with output shapes

On one H200, k3_small's step keeps the GPU busy for well under half its wall time: the host launches
~4,450 kernels per forward/backward pass and cannot keep up. Every aten op the dispatcher runs below
autograd is one or more kernel launches on CUDA, so the number of aten ops per step, and the CPU time
the framework spends around them, are what this proxy reports. It builds recipes/k3_small.yaml's layer
structure unchanged (16 layers = 12 KDA + 4 gated NoPE MLA, SiTU-GLU, AttnRes blocks of 12 sub-layers,
64 experts top-8 + 2 shared, latent MoE, the moonep backend at EP = 1 in a one-rank gloo group, FSDP2
at world 1, 4 micro-passes per step, dense params kept gathered over the passes) with tiny widths and
a short sequence, so that the arithmetic is negligible next to the host work.

What runs differently from the GPU step, and how the count stays that of the GPU's launches:
train.compile is on, but torch.compile is stood in for (inductor's CPU compile of 16 layers takes
minutes): its regions, exactly those moontrain.parallel.parallelize.compile_dense_parts picks (norms,
attention, AttnRes math, dense FFNs, shared experts, the loss), run eagerly and are labelled "compiled", with the backward of the
autograd nodes they create; the KDA kernel (fla's Triton kernels on the GPU, its PyTorch chunk loop
here) is labelled "kda". Those ops are counted apart: on the GPU they are a few fused kernels. The
rest, "eager", i.e. the routed-expert op and its PyTorch glue, routers, FSDP, gradient accumulation,
clipping and the optimizer, launches on the GPU op by op as counted here, except moonep's data path
and planner, which run their PyTorch specification here (experts.moonep.kernels=auto on the CPU) and
Triton kernels on the GPU (the sites under moonep/planner/reference.py and moonep/datapath/ are that
specification). AdamW is the fused one (optim.fused=true, as on the GPU; the write-back variant is a
Triton kernel, so optim.write_back=false), and moonep's value checks are off as on the GPU. The
compute dtype is --compute-dtype (bfloat16 by default, as on the GPU, so that the casts are the GPU
step's). The op counts are exact and repeatable; the CPU times depend on the machine and include the
CPU's arithmetic (small, but bf16 GEMMs on a CPU are slow). Under TRITON_INTERPRET=1 a moontrain kernel route
(e.g. kernels.router=triton) runs in Triton's interpreter; each of its grid calls counts as one "triton kernel"
region call (one launch on the GPU), its interpreter's own ops apart.

Per step (after --warmup steps): wall ms of --steps plain steps (median), then one step under a
TorchDispatchMode counter (aten ops by region and phase: forward, backward or the rest of the step;
the top eager ops; the top call sites of eager ops (all, and those that launch a kernel): the innermost moontrain / moonep line, FSDP line
or autograd node that dispatched them), then one step under cProfile (the top Python functions by self
CPU time). Prints a table; --out writes JSON (every call site under all_sites).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's shims (kernels looping to runtime bounds)
    import moonep.triton_interpreter  # noqa: F401

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer

# k3_small's structure at tiny widths (the recipe's own keys for everything structural)
TINY = [
    "model.vocab_size=256", "model.hidden_size=64", "model.dense_intermediate_size=128", "model.num_heads=2",
    "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
    "model.v_head_dim=16", "model.kda_num_heads=2", "model.kda_head_dim=16", "model.moe_intermediate_size=64",
    "model.moe_latent_size=32", "parallel.ep=1", "train.compile=true", "train.seq_len=32",
    "train.global_batch_size=4", "train.micro_batch_size=1", "train.log_every=1000", "train.steps=1000",
    "experts.moonep.check_values=false",  # the GPU default (a CPU buffer checks its inputs by default)
    "optim.fused=true", "optim.write_back=false",  # the GPU's one multi-tensor AdamW (write-back is Triton)
    "optim.state_dtype=float32",  # torch's fused AdamW takes fp32 moments (the recipe's bf16 ones: the write-back)
]
OUR_CODE = (f"{os.sep}moontrain{os.sep}", f"{os.sep}moonep{os.sep}")
# moonep's data-path calls (moonep.datapath.interface): one to a few Triton kernels each on the GPU
PATH_CALLS = ("plan", "scatter", "expand", "combine", "prefetch", "reduce_into_owner", "zero_slots",
              "accumulate_wgrad", "gate_up", "glu_forward", "glu_route_backward", "scale_rows")
# ops that launch no kernel on the GPU besides the views (op.is_view): allocation, profiler ranges, host reads
NO_KERNEL = {"empty", "empty_strided", "empty_like", "_record_function_enter_new", "_record_function_exit",
             "_local_scalar_dense", "lift_fresh", "set_", "resize_", "is_nonzero", "is_same_size", "promote_types",
             "result_type"}


class Regions:
    """What the GPU step runs fused or in foreign kernels, marked instead: while the trainer is built,
    torch.compile becomes a wrapper that labels its calls "compiled" (train.compile's regions, exactly
    those compile_dense_parts picks), and torch.compiler.disable one that labels them "kda" (the KDA
    kernel: fla's Triton kernels on the GPU, its PyTorch form here). The autograd nodes created under a
    label keep it (by their sequence numbers), so their backward is attributed to the same region.
    Everything else is "eager": one aten op here is one or more kernel launches on the GPU."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.calls: collections.Counter[str] = collections.Counter()  # region entries (outermost)
        self.changes: list[tuple[int, str]] = [(0, "eager")]  # (first node sequence number, label)

    def current(self) -> str:
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is None:
            return "eager"
        i = bisect.bisect_right(self.changes, (node._sequence_nr(), "~")) - 1
        return self.changes[i][1]

    def mark(self, label: str, fn: Callable) -> Callable:
        """fn, its calls (and the autograd nodes they create) labelled `label`."""
        @functools.wraps(fn)
        def region(*args, **kwargs):
            if not self.stack:
                self.calls[label] += 1
            self.stack.append(label)
            self.changes.append((torch._C._autograd._get_sequence_nr(), label))
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                self.changes.append((torch._C._autograd._get_sequence_nr(), self.stack[-1] if self.stack else "eager"))

        return region

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """torch.compile and torch.compiler.disable replaced by the labelling wrappers."""
        compile_, disable = torch.compile, torch.compiler.disable

        def fake_compile(fn=None, **kwargs):
            return (lambda f: self.mark("compiled", f)) if fn is None else self.mark("compiled", fn)

        def fake_disable(fn=None, **kwargs):
            return (lambda f: self.mark("kda", f)) if fn is None else self.mark("kda", fn)

        torch.compile, torch.compiler.disable = fake_compile, fake_disable
        try:
            yield
        finally:
            torch.compile, torch.compiler.disable = compile_, disable


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched below autograd by region (Regions), by name and by call site (the
    innermost frame in moontrain / moonep, FSDP, or the autograd node running)."""

    def __init__(self, regions: Regions, sites: bool, op: str | None = None) -> None:
        super().__init__()
        self.regions, self.sites, self.op = regions, sites, op
        self.op_sites: collections.Counter[str] = collections.Counter()  # --op: its calls in every region
        self.by_region: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()  # eager ops only
        self.launching = 0  # eager ops that launch a kernel on the GPU (neither a view nor in NO_KERNEL)
        self.by_site: collections.Counter[str] = collections.Counter()  # eager ops only
        self.launching_sites: collections.Counter[str] = collections.Counter()  # eager launching ops only
        self.phase = "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        region = self.regions.current()
        self.by_region[f"{region} {self.phase}"] += 1
        if region == "eager":
            name = str(func.overloadpacket.__name__)
            self.ops[name] += 1
            launches = not (func.is_view or name in NO_KERNEL)
            self.launching += launches
            if self.sites:
                site = f"{self.phase:8s} {_call_site()}"
                self.by_site[site] += 1
                self.launching_sites[site] += launches
        out = func(*args, **(kwargs or {}))
        if self.sites and self.op == func.overloadpacket.__name__:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else "-"
            dtype = str(out.dtype).removeprefix("torch.") if isinstance(out, torch.Tensor) else ""
            self.op_sites[f"{self.phase:8s} {region:11s} {shape} {dtype} {_call_site()}"] += 1
        return out


def _call_site() -> str:
    """The innermost moontrain / moonep frame, else the innermost torch.distributed frame (FSDP's hooks),
    else the autograd node running (a built-in op's backward), else the innermost Python frame."""
    frames = traceback.extract_stack(limit=60)[:-3]  # drop this module's own frames
    for frame in reversed(frames):
        if any(part in frame.filename for part in OUR_CODE):
            path = frame.filename[frame.filename.rfind(os.sep + "moon") + 1:]
            return f"{path}:{frame.lineno} {frame.name}"
        if f"{os.sep}distributed{os.sep}" in frame.filename:
            path = frame.filename[frame.filename.rfind(os.sep + "torch" + os.sep) + 1:]
            return f"{path}:{frame.lineno} {frame.name}"
        if frame.filename.endswith(("autograd/__init__.py", "autograd/graph.py", "_tensor.py")):
            break  # the autograd engine's C++ calls: no Python frame of its own below this
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"autograd {node.name()}"
    frame = frames[-1] if frames else None
    return f"{frame.filename}:{frame.lineno} {frame.name}" if frame else "?"


def build_trainer(overrides: list[str], run_dir: str, regions: Regions) -> Trainer:
    raw = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "k3_small.yaml",
                      [*TINY, f"train.run_dir={run_dir}", *overrides])
    cfg = from_dict(RunConfig, raw)
    layout = build_layout(cfg.parallel.ep, torch.device("cpu"))
    with regions.standing_in():
        trainer = Trainer(cfg, layout)
    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels.*=triton in the interpreter: one launch per grid call
        from triton.runtime import interpreter

        interpreter.GridExecutor.__call__ = regions.mark("triton kernel", interpreter.GridExecutor.__call__)
    buffer = getattr(trainer.experts_runtime, "buffer", None)
    if buffer is not None:  # moonep: its data path's calls are Triton kernels on the GPU
        path = buffer.path
        for name in PATH_CALLS:
            setattr(path, name, regions.mark("moonep path", getattr(path, name)))
    return trainer


def count_step(trainer: Trainer, regions: Regions, sites: bool, op: str | None = None) -> OpCounter:
    """One training step under the counter; the phase of each op is forward, backward or step."""
    counter = OpCounter(regions, sites, op)
    regions.calls.clear()
    forward, backward = trainer.model.forward, torch.Tensor.backward

    def counted_forward(*a, **k):
        counter.phase = "forward"
        try:
            return forward(*a, **k)
        finally:
            counter.phase = "step"

    def counted_backward(self, *a, **k):
        counter.phase = "backward"
        try:
            return backward(self, *a, **k)
        finally:
            counter.phase = "step"

    trainer.model.forward = counted_forward
    torch.Tensor.backward = counted_backward
    try:
        with counter:
            trainer.train_step()
    finally:
        del trainer.model.forward
        torch.Tensor.backward = backward
    counter.calls = dict(regions.calls)
    return counter


def profile_step(trainer: Trainer, top: int) -> list[dict]:
    """One training step under cProfile: the top functions by self (tottime) CPU time."""
    prof = cProfile.Profile()
    prof.enable()
    trainer.train_step()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (filename, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        short = filename[filename.rfind(os.sep + "moon") + 1:] if any(p in filename for p in OUR_CODE) else filename
        rows.append({"site": f"{short}:{line} {fn}", "calls": ncalls, "self_ms": tottime * 1e3,
                     "cum_ms": cumtime * 1e3})
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:top]


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    overrides = [f"parallel.compute_dtype={args.compute_dtype}", *args.overrides]
    regions = Regions()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(overrides, run_dir, regions)
        try:
            for _ in range(args.warmup):
                trainer.train_step()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                trainer.train_step()
                times.append((time.perf_counter() - t0) * 1e3)
            counter = count_step(trainer, regions, sites=True, op=args.op)
            plain = count_step(trainer, regions, sites=False)  # the sites' stack walks change no op
            assert plain.by_region == counter.by_region, "the op counts differ between two steps"
            functions = profile_step(trainer, args.top)
            passes = trainer.accumulation_steps
        finally:
            trainer.close()
    dist.destroy_process_group()
    return {
        "config": {"overrides": overrides, "passes_per_step": passes, "torch": torch.__version__,
                   "threads": args.threads},
        "wall_ms_per_step": statistics.median(times),
        "wall_ms_all": times,
        "eager_ops_per_step": sum(counter.ops.values()),
        "eager_launching_ops_per_step": counter.launching,
        "ops_by_region_phase": dict(sorted(counter.by_region.items())),
        "region_calls_per_step": counter.calls,
        "top_ops": counter.ops.most_common(args.top),
        "top_sites": counter.by_site.most_common(args.top),
        "all_sites": dict(counter.by_site),
        "launching_sites": dict(+counter.launching_sites),
        "top_functions": functions,
        "op": args.op,
        "op_sites": counter.op_sites.most_common(),
    }


def show(result: dict) -> None:
    cfg = result["config"]
    print(f"host overhead proxy: k3_small structure, tiny widths, {cfg['passes_per_step']} passes per step, "
          f"torch {cfg['torch']}, {cfg['threads']} threads; overrides {' '.join(cfg['overrides'])}")
    regions = ", ".join(f"{k} {v}" for k, v in result["ops_by_region_phase"].items())
    print(f"wall {result['wall_ms_per_step']:.1f} ms per step (median); eager aten ops per step "
          f"{result['eager_ops_per_step']}, of which {result['eager_launching_ops_per_step']} launch a kernel "
          f"on the GPU (not a view)\naten ops by region and phase: {regions}\nregion calls per step: "
          f"{result['region_calls_per_step']}")
    print("\ntop eager aten ops per step:")
    for name, n in result["top_ops"]:
        print(f"  {n:7d}  {name}")
    print("\ntop call sites of eager ops (phase, innermost moontrain/moonep line, FSDP line or autograd node):")
    for site, n in result["top_sites"]:
        print(f"  {n:7d}  {site}")
    if "launching_sites" in result:
        print("\ntop call sites of eager ops that launch a kernel on the GPU:")
        top = sorted(result["launching_sites"].items(), key=lambda kv: -kv[1])[:len(result["top_sites"])]
        for site, n in top:
            print(f"  {n:7d}  {site}")
    if result.get("op"):
        print(f"\ncall sites of aten.{result['op']} in every region (phase, region, output shape and dtype, site):")
        for site, n in result["op_sites"]:
            print(f"  {n:7d}  {site}")
    print("\ntop Python functions by self CPU time (one step under cProfile, which inflates them):")
    print(f"  {'self ms':>8s} {'cum ms':>8s} {'calls':>7s}  function")
    for r in result["top_functions"]:
        print(f"  {r['self_ms']:8.1f} {r['cum_ms']:8.1f} {r['calls']:7d}  {r['site']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value, applied after the tiny widths")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=40, help="rows per table")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: host work, not math)")
    parser.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--op", help="an aten op (e.g. add, copy_, _to_copy): its call sites in every region, "
                                     "with output shapes (tiny widths: hidden 64, 32 tokens a pass)")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--show", help="print the table of a JSON written by --out and exit")
    args = parser.parse_args()
    if args.show:
        show(json.loads(Path(args.show).read_text()))
        return
    result = run(args)
    show(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
