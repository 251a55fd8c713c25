"""moontrain.model.kda.short_conv_kernel in Triton's interpreter on the CPU: y, dx and dw against the float64
specification (kda.short_conv) within the derived bound of tests/moontrain/model/kda/short_conv_cases.py, the
validation messages, and torch.compile tracing through the custom op (in a subprocess without the
interpreter: wrap_triton cannot trace an interpreted kernel)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported (triton reads it then), installs the
# interpreter's numpy-2 shim, and skips this module too where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.kda import short_conv_kernel
from moontrain.model.kda.short_conv_kernel import ShortConvFunction, short_conv_silu
from tests.moontrain.model.kda.short_conv_cases import check_short_conv, conv_inputs, doc_ids

B, T, C = 2, 70, 72
# row 0: documents of length 1 (t = 0 and t = 20), a start on a 32-row block boundary (t = 32) and one a
# row past one (t = 65: row 64's halo rows 65, 66 and its taps 62, 63 both cross a document start);
# row 1: a length-1 document at t = 5
STARTS = [[1, 20, 21, 32, 65], [5, 6, 40]]
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.float32),
          "bf16_w": (torch.bfloat16, torch.bfloat16)}


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles smaller than the GPU's, so T = 70 spans several time blocks (the last partial) and C = 72 two
    channel blocks of 64 (the second partial) in both kernels."""
    monkeypatch.setattr(short_conv_kernel, "FWD_BLOCK_T", 16)
    monkeypatch.setattr(short_conv_kernel, "FWD_BLOCK_C", 64)
    monkeypatch.setattr(short_conv_kernel, "BWD_BLOCK_T", 32)
    monkeypatch.setattr(short_conv_kernel, "WALK_SPAN", 16)  # the walk: spans of 16 rows (five, the last partial)
    monkeypatch.setattr(short_conv_kernel, "WALK_BLOCK_C", 64)


@pytest.mark.parametrize("backward", ["tiles", "walk"])
@pytest.mark.parametrize(("dtypes", "W", "docs"), [(d, W, docs) for d in ("fp32", "bf16")
                                                    for W, docs in ((4, True), (4, False), (3, True), (1, True))]
                         + [("bf16_w", 4, True)])
def test_short_conv_matches_spec(dtypes: str, W: int, docs: bool, backward: str, small_blocks: None) -> None:
    """Both backward routes (kernels.short_conv_backward). The walk's spans of 16 rows put document starts on
    a span's first row (t = 32), one and two rows below a span's end (t = 65: its taps from the span above), and
    documents of one token at span edges (t = 20, 21)."""
    x, w, dy = conv_inputs(B, T, C, W, *DTYPES[dtypes], "cpu", seed=W)
    check_short_conv(x, w, doc_ids(B, T, STARTS, "cpu") if docs else None, dy, backward)


@pytest.mark.parametrize("backward", ["tiles", "walk"])
def test_short_conv_gpu_tiles_match_spec(backward: str) -> None:
    """The GPU's tile sizes: T over three forward time blocks and two backward ones (the walk: two spans, the
    last partial), C inside one forward channel block and over two backward ones (inside one walk block)."""
    x, w, dy = conv_inputs(B, T, C, 4, torch.bfloat16, torch.float32, "cpu", seed=1)
    check_short_conv(x, w, doc_ids(B, T, STARTS, "cpu"), dy, backward)


def test_autograd_function_matches_op_bitwise() -> None:
    """ShortConvFunction.apply (eager) and the custom op share setup_context and backward: same bits."""
    x, w, dy = conv_inputs(B, T, C, 4, torch.bfloat16, torch.float32, "cpu", seed=2)
    doc_id = doc_ids(B, T, STARTS, "cpu")
    outs = []
    for fn in (short_conv_silu, ShortConvFunction.apply):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = fn(xg, wg, doc_id)
        outs.append((y, *torch.autograd.grad(y, (xg, wg), dy)))
    for name, a, b in zip(("y", "dx", "dw"), *outs, strict=True):
        assert torch.equal(a, b), f"{name}: first mismatch at {(a != b).nonzero()[0].tolist()}"


def test_validation_messages() -> None:
    x = torch.randn(2, 9, 8)
    w = torch.randn(8, 1, 4)
    with pytest.raises(ValueError, match=r"x must be \[B, T, C\], got shape \(18, 8\)"):
        short_conv_silu(x.view(18, 8), w, None)
    with pytest.raises(ValueError, match=r"w must be \[C, 1, W\] = \[8, 1, W\].*got shape \(8, 4\)"):
        short_conv_silu(x, w[:, 0], None)
    with pytest.raises(ValueError, match=r"unit channel stride, got strides \(72, 1, 9\)"):
        short_conv_silu(x.transpose(1, 2).contiguous().transpose(1, 2), w, None)
    with pytest.raises(ValueError, match=r"x has dtype torch.float64.*float32, bfloat16 or float16"):
        short_conv_silu(x.double(), w, None)
    with pytest.raises(ValueError, match=r"doc_id must be int64 \[B, T\] = \[2, 9\], got torch.int64 \(2, 8\)"):
        short_conv_silu(x, w, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got torch\.int32"):
        short_conv_silu(x, w, torch.zeros(2, 9, dtype=torch.int32))
    wide = torch.empty(1, 2 ** 20, 2 ** 11 + 8, device="meta")[..., :8]  # 2^20 rows of stride 2^11 + 8
    with pytest.raises(ValueError, match=r"T \* row stride = 1048576 \* 2056 does not fit .* int32 row offsets"):
        short_conv_silu(wide, w.to("meta"), None)
    with pytest.raises(ValueError, match=r"different devices \['cpu', 'meta'\]"):
        short_conv_silu(x, w.to("meta"), None)
    with pytest.raises(ValueError, match=r"backward must be 'tiles' or 'walk', got 'fast'"):
        short_conv_silu(x, w, None, backward="fast")
    with pytest.raises(ValueError, match=r"the walking backward takes at most 4 taps, w has 5; "
                                         r"kernels.short_conv_backward=tiles takes any"):
        short_conv_silu(x, torch.randn(8, 1, 5), None, backward="walk")


_TRACE_SCRIPT = """
import functools
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
import torch._higher_order_ops.triton_kernel_wrap as triton_kernel_wrap
from moontrain.model.kda.short_conv_kernel import short_conv_silu

# without a driver torch cannot analyse a kernel and takes every argument as written; a GPU's analysis finds
# the kernels' stores, which write only their outputs: stand in for it with those
OUTPUTS = {"y_ptr", "dpre_ptr", "dw_part_ptr", "dx_ptr"}
triton_kernel_wrap.get_mutated_tensors = lambda kernel_idx, constant_args_idx, kwargs, tma: [
    name for name in kwargs if name in OUTPUTS]
graphs = []

def capture(gm, example_inputs):
    graphs.append(gm)
    return gm

def f(x, w, doc_id, a, b, backward):
    return short_conv_silu((x @ a)[..., :8], w, doc_id, backward=backward) @ b  # the conv reads a column slice

for doc_id, backward in ((torch.zeros(2, 9, dtype=torch.long), "tiles"), (None, "tiles"), (None, "walk")):
    compiled = torch.compile(functools.partial(f, backward=backward), fullgraph=True,
                             backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    args = (torch.randn(2, 9, 6), torch.randn(8, 1, 4, requires_grad=True), doc_id,
            torch.randn(6, 16, requires_grad=True), torch.randn(8, 5))
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        try:
            compiled(*args)
        except RuntimeError as e:  # the traced graph's first launch: no Triton driver on this machine
            assert "active drivers" in str(e), e
for gm in graphs:
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in gm.graph.nodes
               if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    print("GRAPH", ",".join(kernels), sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes))
"""


def test_torch_compile_traces_through_fullgraph() -> None:
    """torch.compile(fullgraph=True) of matmul -> column slice -> short_conv_silu -> matmul gives one forward
    and one backward graph (with document ids and without; the walking backward) holding the Triton kernels and the
    matmuls around them. Tracing needs the
    uninterpreted kernels (wrap_triton returns an interpreted one as is), so it runs in a subprocess
    without TRITON_INTERPRET; on the CPU the graph cannot launch them, so it stops at the first launch, and
    the kernels' written arguments are their outputs (what torch's analysis of the compiled kernel finds on
    a GPU; on the CPU it cannot compile them and would take every argument as written)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[3]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_TRACE_SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    graphs = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("GRAPH")]
    # forward: two matmuls around the conv; backward: dx's and da's matmuls (b and x need no grad)
    want = ([["_short_conv_fwd_kernel", "2"], ["_short_conv_dpre_kernel,_short_conv_dx_kernel", "2"]] * 2  # docs, none
            + [["_short_conv_fwd_kernel", "2"], ["_short_conv_bwd_walk_kernel", "2"]])  # the walking backward
    assert graphs == want, run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("gate_rank", [None, 4])
def test_kda_layer_with_the_kernel_equals_the_specification(gate_rank: int | None) -> None:
    """KimiDeltaAttention with kernels.short_conv=triton (the kernel reading project()'s column slices) against
    the same layer with the PyTorch convolution, fp32, with documents: output and every parameter's grad
    within 1e-5 relative (the two differ by the conv's summation order and rounding only)."""
    from moontrain.model.config import ModelConfig
    from moontrain.model.documents import document_mask
    from moontrain.model.kda.layer import KimiDeltaAttention

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_dense_layers=1, dense_intermediate_size=64,
                      num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      kda_layers_per_mla=1, kda_num_heads=3, kda_head_dim=8, kda_gate_rank=gate_rank)
    torch.manual_seed(0)
    spec = KimiDeltaAttention(cfg, kernel="torch", conv="torch")
    spec.init_parameters(torch.Generator().manual_seed(0))  # A_log, dt_bias, the conv taps (torch.empty before)
    kern = KimiDeltaAttention(cfg, kernel="torch", conv="triton")
    kern.load_state_dict(spec.state_dict())
    tokens = torch.randint(0, 63, (2, 40))
    tokens[0, 9] = tokens[1, 0] = tokens[1, 25] = 63  # documents start at 10 and at 1 and 26
    docs = document_mask(tokens, 63)
    x = torch.randn(2, 40, 32)
    outs = []
    for m in (spec, kern):
        y = m(x, docs=docs)
        grads = torch.autograd.grad(y, list(m.parameters()), torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
        outs.append((y, grads))
    (y_ref, g_ref), (y, g) = outs
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
    for (name, _), a, b in zip(spec.named_parameters(), g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=lambda m, n=name: f"{n}: {m}")
