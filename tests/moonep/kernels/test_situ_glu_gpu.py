"""SiTU-GLU's Triton kernels on the GPU against the exact values, within the bound derived in
tests/moonep/helpers/situ_glu_cases.py (the device's exp and fp32 division are approximate, so the GPU is not
bitwise equal to the PyTorch specification; the interpreter test pins the operation order)."""

from __future__ import annotations

import pytest
import torch

from moonep.activation import situ_glu_backward as spec_backward
from tests.moonep.helpers.situ_glu_cases import assert_close_to_exact, exact, situ_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("N", "F"), [(67, 300), (4099, 1024)])
def test_situ_glu_kernels_gpu(N: int, F: int) -> None:
    from moonep.kernels.situ_glu import situ_glu_backward, situ_glu_forward

    h, u, grad_a = situ_inputs(3, N, F, device="cuda")
    ref = exact(grad_a, h, u)
    assert_close_to_exact("a (forward)", situ_glu_forward(h, u), ref["a"])
    got = situ_glu_backward(grad_a, h, u)
    for name, value in zip(("grad_h", "grad_u", "a"), got, strict=True):
        assert_close_to_exact(name, value, ref[name])
    spec = spec_backward(grad_a, h, u)  # the PyTorch path on the GPU: same bound
    for name, value in zip(("grad_h", "grad_u", "a"), spec, strict=True):
        assert_close_to_exact(f"{name} (PyTorch)", value, ref[name])
        # rare one-ulp differences from the device exp; most elements identical
        same = float((value.view(torch.int16) == got[("grad_h", "grad_u", "a").index(name)].view(torch.int16))
                     .float().mean())
        assert same > 0.98, f"{name}: only {same:.3f} of elements equal the PyTorch path's"


def test_differentiable_op_runs_the_kernels_gpu() -> None:
    """moonep.situ_glu (moonep.activation) on bf16 CUDA tensors (the dense FFNs' and shared experts' path): values
    and gradients equal the kernels' bit for bit."""
    from moonep import situ_glu
    from moonep.kernels.situ_glu import situ_glu_backward, situ_glu_forward

    h, u, grad_a = situ_inputs(4, 515, 384, device="cuda")
    h.requires_grad_()
    u.requires_grad_()
    a = situ_glu(h, u)
    a.backward(grad_a)
    want_h, want_u, _ = situ_glu_backward(grad_a, h.detach(), u.detach())
    assert torch.equal(a.detach(), situ_glu_forward(h.detach(), u.detach()))
    assert torch.equal(h.grad, want_h) and torch.equal(u.grad, want_u)
