"""What torch.compile generates for the K3 layers' compiled regions as a GPU step compiles them, read on the CPU:
per graph (forward and backward of each compiled region), the launches of user Triton kernels with the tensor
each reads first, the extern GEMMs, inductor's own kernels and every buffer it allocates. A copy shows up as a
user launch reading a buffer inductor allocated and filled (`buf12`) where eager hands it a view
(`reinterpret_tensor(...)` of another buffer) or a saved tensor (`getitem`), beside a kernel that fills it.

    python benchmarks/diagnostics/inductor_code.py --layers 4 kernels.kda=torch kernels.attn_res=torch \\
        kernels.lm_loss=torch model.num_experts=8 model.vocab_size=4096
    python benchmarks/diagnostics/inductor_code.py --padding cpu ...   # inductor's CPU choice: no padding

How, without a GPU: the model (op_sites.build: the recipe's first --layers layers, bf16, the experts on the
`local` backend, compile_dense_parts) runs one forward + backward on CPU tensors with Triton's active driver
replaced by one that names an sm90 target (the user kernels' launches are traced and analysed as on the GPU),
their launches turned into no-ops (the values are garbage: only the code is read), inductor compiling in this
process (the patches hold there) and its comprehensive padding on, as on a GPU (inductor turns it off on the
CPU; --padding cpu keeps that), each region's own options applying on top (KimiDeltaAttention.compile turns
it off). Inductor's own kernels are C++ here, not Triton: their fusion can
differ from the GPU's; the graph, the extern calls, the user launches' arguments and the padding do not.
GPU machines run torch 2.11, whose padding differs from later releases (docs/performance.md, 2026-12-05):
run this under the GPU's torch (a venv with `pip install torch==2.11.0`) to see what the GPU compiles.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))


def emulate_gpu_compile(padding: str) -> None:
    """The patches of the module docstring, in place, for this process."""
    import torch._inductor.config as inductor_config
    import triton.runtime as triton_runtime
    from torch._inductor.runtime import triton_heuristics

    class Sm90Driver:  # what Triton's tracing of a user kernel asks the driver for
        def get_current_target(self):
            from triton.backends.compiler import GPUTarget

            return GPUTarget("cuda", 90, 32)

        def __getattr__(self, name: str):
            raise RuntimeError(f"inductor_code.py: no GPU driver here ({name}); only code generation runs")

    triton_runtime.driver.set_active(Sm90Driver())
    triton_heuristics.CachingAutotuner.precompile = lambda self, *args, **kwargs: None
    triton_heuristics.CachingAutotuner.run = lambda self, *args, **kwargs: None
    inductor_config.compile_threads = 1
    inductor_config.disable_padding_cpu = padding == "cpu"


def graph_summary(code: str) -> list[str]:
    """Lines describing one generated module's call(): user launches with their first argument, extern calls,
    inductor kernels, allocations."""
    body = code[code.index("def call(self, args):"):] if "def call(self, args):" in code else code
    lines = [f"user   {m.group(1)} <- {m.group(2).strip()}"
             for m in re.finditer(r"(\w+)\.run\(\s*(reinterpret_tensor\((?:[^()]|\([^()]*\))*\)|[^,]+),", body)]
    lines += [f"extern {name}" for name in re.findall(r"extern_kernels\.(\w+)\(", body)]
    lines += [f"kernel {name}" for name in re.findall(r"^\s+(cpp_fused\w*)\(", body, re.M)]
    lines += [f"alloc  {shape} strides {stride} {dtype}" for shape, stride, dtype
              in re.findall(r"empty_strided_\w+\((\([^)]*\)), (\([^)]*\)), torch\.(\w+)\)", body)]
    return lines


def main() -> None:
    import op_sites
    from torch._inductor.utils import run_and_get_code

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    op_sites.model_arguments(p, batch=1, seq=128)
    p.add_argument("--padding", choices=["gpu", "cpu"], default="gpu",
                   help="gpu: inductor's comprehensive padding as on a GPU (default); cpu: as on the CPU (none)")
    args = p.parse_args()
    emulate_gpu_compile(args.padding)
    build_args = argparse.Namespace(recipe=args.recipe, layers=args.layers, batch=args.batch, seq=args.seq,
                                    compile=True, compute_dtype="bfloat16", overrides=args.overrides)
    model, tokens = op_sites.build(build_args, torch.device("cpu"))
    _, codes = run_and_get_code(lambda: model(tokens, tokens.roll(-1, 1))[0].backward())
    print(f"torch {torch.__version__}, {len(codes)} generated modules (compiled regions' forwards and backwards)")
    for i, code in enumerate(codes):
        print(f"=== module {i}")
        for line in graph_summary(code):
            print(f"    {line}")


if __name__ == "__main__":
    main()
