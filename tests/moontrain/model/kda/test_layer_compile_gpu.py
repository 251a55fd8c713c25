"""The compiled KDA layer reads its stacked projection's columns in place on the GPU (KimiDeltaAttention.compile).

Data movement, checked in inductor's generated code of one forward + backward: every launch of the
convolution kernels that read x (forward, dpre) reads a view of the projection's output or the tensor saved
for backward, never a buffer inductor allocated and filled. Such a buffer is a copy: the convolutions'
Triton launches carry their input's strides as traced (the projection's unpadded row stride),
so where inductor pads the projection's output, it copies each q / k / v slice to those strides before the
forward's and the backward's kernels. A control compiles the same layer with inductor's defaults
(nn.Module.compile): on torch 2.11, whose contiguity query pads the projection's output, it makes the six
copies this test looks for, so the test can fail there.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from moontrain.model.config import ModelConfig
from moontrain.model.kda.layer import KimiDeltaAttention

pytestmark = pytest.mark.gpu

B, T, H, K, D = 2, 256, 4, 128, 512  # 5 H K + H = 2,564 columns: above inductor's padding threshold, not 64-aligned


def _layer() -> KimiDeltaAttention:
    cfg = ModelConfig(hidden_size=D, kda_layers_per_mla=3, kda_num_heads=H, kda_head_dim=K, vocab_size=64,
                      num_layers=4, dense_intermediate_size=256, num_heads=2, kv_lora_rank=32, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64)
    layer = KimiDeltaAttention(cfg, kernel="torch", conv="triton", device="cuda")
    layer.init_parameters(torch.Generator(device="cuda").manual_seed(0))
    return layer.to(torch.bfloat16)


def _copied_inputs(layer: KimiDeltaAttention) -> list[str]:
    """The launches, in inductor's generated code of one forward and backward of `layer` (already compiled), of
    the convolution kernels that read x (forward, dpre) whose x is a buffer inductor allocated, not a view of
    the projection's output or a saved tensor: each such buffer is a copy of a projection slice."""
    x = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, codes = run_and_get_code(lambda: layer(x).float().square().mean().backward())
    launch = re.compile(r"(_short_conv_(?:fwd|dpre)_kernel\w*)\.run\(\s*([^,]+),")
    launches = [m for code in codes for m in launch.finditer(code)]
    assert len(launches) == 6, f"expected three forward and three dpre launches, got {[m.group(0) for m in launches]}"
    return [m.group(0) for m in launches if re.fullmatch(r"buf\d+", m.group(2).strip())]


def test_compiled_layer_reads_the_projection_in_place() -> None:
    torch._dynamo.reset()
    layer = _layer()
    layer.compile()
    copies = _copied_inputs(layer)
    assert not copies, f"the compiled layer copies projection slices for these launches: {copies}"

    torch._dynamo.reset()
    control = _layer()
    nn.Module.compile(control)  # inductor's defaults: comprehensive padding on
    control_copies = _copied_inputs(control)
    if torch.__version__.startswith("2.11"):
        assert len(control_copies) == 6, f"torch 2.11 with padding: expected all six launches on copies, got {control_copies}"
