"""Where the large outputs of chosen aten ops come from in one forward + backward of a K3 layer stack, on the GPU
(fla's KDA, the Triton kernels, the recipe's widths) or the CPU: per op, output shape and dtype, the inputs'
shapes, dtypes and contiguity, and the call site (the innermost moontrain / moonep frame, the innermost fla
frame, or the autograd node running).

    python benchmarks/diagnostics/op_sites.py --layers 4 --op copy_ clone _to_copy cat        # one H200
    python benchmarks/diagnostics/op_sites.py --layers 4 --batch 1 --seq 256 model.hidden_size=256 ...  # CPU
    TORCH_LOGS=output_code python benchmarks/diagnostics/op_sites.py --layers 4 --compile 2> output_code.log

host_overhead.py --op answers the same question on the CPU proxy, where KDA is its PyTorch specification;
this one runs the model as the GPU step does, to find copies that fla's kernels or their input guards make.
The model: the recipe's model and kernels sections (first --layers layers), its parameters cast to the
compute dtype (parallel.dense=plain's bf16 copies), the routed experts on the `local` backend (grouped GEMMs,
no moonep, no process group), train.compile off. --compile compiles the dense parts as train.compile does:
the compiled graphs' generated kernels are then not counted, the aten ops their code calls and all others
are (fla's, the eager glue between graphs); with TORCH_LOGS=output_code inductor writes the graphs'
generated code to stderr, to read what they copy.
One forward + backward outside the counter first (fla's autotuning, Triton's and inductor's compiles), then
one under a TorchDispatchMode that records every call of the chosen ops whose output has at least
--min-elements elements. Prints a table, largest bytes first; --out writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from moontrain.config import RunConfig
from moontrain.config.loader import load_recipe
from moontrain.dataclass_dict import from_dict
from moontrain.model.experts import ExpertsContext
from moontrain.model.transformer import K3Model
from moontrain.parallel.parallelize import compile_dense_parts

OUR_CODE = (f"{os.sep}moontrain{os.sep}", f"{os.sep}moonep{os.sep}")


def call_site() -> str:
    """The innermost moontrain / moonep frame, with the innermost fla frame below it if any; else the autograd
    node running (a built-in op's backward)."""
    frames = traceback.extract_stack(limit=80)[:-3]
    ours = next((f for f in reversed(frames) if any(p in f.filename for p in OUR_CODE)
                 and "diagnostics" not in f.filename), None)
    fla = next((f for f in reversed(frames) if f"{os.sep}fla{os.sep}" in f.filename), None)
    parts = []
    if ours is not None:
        parts.append(f"{ours.filename[ours.filename.rfind(os.sep + 'moon') + 1:]}:{ours.lineno} {ours.name}")
    if fla is not None:
        parts.append(f"fla/{fla.filename.rsplit(os.sep + 'fla' + os.sep, 1)[1]}:{fla.lineno} {fla.name}")
    node = torch._C._current_autograd_node()
    if node is not None:
        parts.append(f"autograd {node.name()}")
    return " | ".join(parts) or "?"


class OpSites(TorchDispatchMode):
    def __init__(self, ops: set[str], min_elements: int) -> None:
        super().__init__()
        self.ops, self.min_elements = ops, min_elements
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if name in self.ops and isinstance(first, torch.Tensor) and first.numel() >= self.min_elements:
            inputs = tuple((tuple(a.shape), str(a.dtype).removeprefix("torch."), a.is_contiguous())
                           for a in args if isinstance(a, torch.Tensor))[:3]
            key = (name, tuple(first.shape), str(first.dtype).removeprefix("torch."), str(inputs), call_site())
            self.calls[key] += 1
            self.bytes[key] += first.numel() * first.element_size()
        return out


class CompiledOpSites(OpSites):
    """OpSites beside torch.compile: the compiled graphs run compiled (a mode without this would turn
    torch.compile off); their generated kernels are not seen, the aten ops their code calls are."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def build(args: argparse.Namespace, device: torch.device) -> tuple[K3Model, torch.Tensor]:
    raw = load_recipe(args.recipe, [f"model.num_layers={args.layers}", *args.overrides])
    cfg = from_dict(RunConfig, raw)
    model = K3Model(cfg.model, kernels=cfg.kernels, device=device)
    model.init_weights(seed=0)
    if args.compile:
        compile_dense_parts(model)
    dtype = getattr(torch, args.compute_dtype)
    model.to(dtype)
    mc = cfg.model
    model.attach_experts_backends("local", ExpertsContext(
        num_experts=mc.num_experts, topk=mc.num_experts_per_tok, ep_group=None, ep=1, compute_dtype=dtype,
        token_padding=cfg.experts.token_padding, max_tokens=args.batch * args.seq, device=device,
        activation=mc.ffn_activation))
    tokens = torch.randint(0, mc.vocab_size, (args.batch, args.seq), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    return model, tokens


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokens = build(args, device)
    t0 = time.perf_counter()
    model(tokens, tokens.roll(-1, 1))[0].backward()  # compiles and autotuning outside the count
    print(f"warm-up pass {time.perf_counter() - t0:.1f} s", flush=True)
    min_elements = args.min_elements or args.batch * args.seq * model.cfg.hidden_size // 2
    mode = (CompiledOpSites if args.compile else OpSites)(set(args.op), min_elements)
    with mode:
        model(tokens, tokens.roll(-1, 1))[0].backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rows = [{"op": k[0], "shape": list(k[1]), "dtype": k[2], "inputs": k[3], "site": k[4], "calls": n,
             "mib": mode.bytes[k] / 2**20} for k, n in mode.calls.items()]
    rows.sort(key=lambda r: -r["mib"])
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "layers": args.layers,
            "compile": args.compile,
            "batch": args.batch, "seq": args.seq, "ops": args.op, "overrides": args.overrides, "rows": rows}


def model_arguments(p: argparse.ArgumentParser, batch: int, seq: int) -> None:
    """build()'s arguments: recipe overrides, --recipe, --layers, --batch, --seq (defaults `batch`, `seq`)."""
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value (model.*, kernels.*)")
    p.add_argument("--recipe", default=str(Path(__file__).resolve().parents[2] / "recipes" / "k3_small.yaml"))
    p.add_argument("--layers", type=int, default=4, help="the recipe's first layers (4: dense KDA, 2 KDA, 1 MLA)")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p, batch=4, seq=4096)
    p.add_argument("--op", nargs="+", default=["copy_", "clone", "_to_copy", "cat", "contiguous"])
    p.add_argument("--min-elements", type=int, default=0, help="default: half of batch x seq x hidden")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--compile", action="store_true", help="the dense parts through torch.compile (train.compile)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", help="JSON path")
    args = p.parse_args()
    result = run(args)
    print(f"{'calls':>5} {'MiB':>8}  op / output / inputs (shape, dtype, contiguous) / site")
    for r in result["rows"][:args.top]:
        print(f"{r['calls']:>5} {r['mib']:>8.0f}  {r['op']} {tuple(r['shape'])} {r['dtype']} from {r['inputs']}\n"
              f"{'':>16}at {r['site']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
