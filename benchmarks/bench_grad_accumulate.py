"""parallel.dense=plain's grad accumulation on one GPU: a later pass's bf16 grads added into the fp32
accumulators of k3_small's dense parameters, by the foreach path (moontrain.parallel.plain_dense: a widened copy
into a 256 MiB fp32 scratch, group by group, then a foreach add) against one launch of
moontrain.parallel.grad_accumulate_kernel (parallel.plain_accumulate=triton).

    python benchmarks/bench_grad_accumulate.py [--recipe recipes/k3_small.yaml] [--iters 20] [--out FILE]

The parameter shapes are the recipe's dense ones (every parameter but the expert masters, from the model built on
the meta device). Per path: the median ms of CUDA-event timings of one pass's accumulation, and the HBM rate of the
least traffic (10 bytes an element: the grad read, the accumulator read and written); the two paths' accumulators
must be bitwise equal. GPU only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import kernel_bench_args, median_ms
from moontrain.config.loader import load_recipe
from moontrain.model.config import ModelConfig
from moontrain.model.transformer import K3Model
from moontrain.parallel import plain_dense
from moontrain.parallel.fsdp import expert_master_params
from moontrain.parallel.grad_accumulate_kernel import GradAccumulator


def dense_shapes(recipe: str) -> list[tuple[int, ...]]:
    from moontrain.dataclass_dict import from_dict

    cfg = from_dict(ModelConfig, load_recipe(recipe, [])["model"])
    model = K3Model(cfg, device="meta")
    experts = expert_master_params(model)
    return [tuple(p.shape) for p in model.parameters() if p not in experts]


def foreach_path(accs: list[torch.Tensor], grads: list[torch.Tensor], scratch: torch.Tensor) -> None:
    for lo, hi in plain_dense._scratch_groups([a.numel() for a in accs], scratch.numel()):
        views, offset = [], 0
        for a in accs[lo:hi]:
            views.append(scratch[offset: offset + a.numel()].view_as(a))
            offset += a.numel()
        torch._foreach_copy_(views, grads[lo:hi])
        torch._foreach_add_(accs[lo:hi], views)


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_grad_accumulate", recipe={"default": "recipes/k3_small.yaml"})
    shapes = dense_shapes(args.recipe)
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(s, device="cuda", generator=gen).bfloat16() for s in shapes]
    start = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    biggest = max(torch.Size(s).numel() for s in shapes)
    scratch = torch.empty(max(biggest, plain_dense.SCRATCH_BYTES // 4), device="cuda")
    accumulator = GradAccumulator()
    rows, results = [], {}
    for name, run in (("foreach (scratch copy + add)", lambda a: foreach_path(a, grads, scratch)),
                      ("triton (one launch)", lambda a: accumulator.add_(a, grads))):
        accs = [t.clone() for t in start]
        run(accs)
        results[name] = accs
        ms = median_ms(lambda run=run, accs=accs: run(accs), args.iters, args.warmup)
        rows.append({"path": name, "ms": ms, "tb_s": 10 * numel / ms / 1e9})
    a, b = results.values()
    equal = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    print(f"{args.recipe}: {len(shapes)} dense parameters, {numel / 1e9:.3f} G elements; {torch.cuda.get_device_name()}")
    print(f"{'path':<30} {'ms':>8} {'TB/s':>6}")
    for r in rows:
        print(f"{r['path']:<30} {r['ms']:8.3f} {r['tb_s']:6.2f}")
    print(f"accumulators bitwise equal after one pass: {equal}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "recipe": args.recipe,
                                              "params": len(shapes), "elements": numel, "rows": rows,
                                              "bitwise_equal": equal}, indent=1))
    if not equal:
        raise SystemExit("the two paths' accumulators differ")


if __name__ == "__main__":
    main()
