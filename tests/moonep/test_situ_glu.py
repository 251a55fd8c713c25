"""SiTU-GLU's PyTorch specification in moonep.activation, against the exact (fp64, textbook formula)
values within the bound derived in tests/moonep/helpers/situ_glu_cases.py; the differentiable op's gradients
are the one-pass backward's."""

from __future__ import annotations

import pytest
import torch

from moonep.activation import situ_glu, situ_glu_backward, situ_glu_forward
from tests.moonep.helpers.situ_glu_cases import assert_close_to_exact, exact, situ_inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_specification_matches_exact_values(dtype: torch.dtype) -> None:
    h, u, grad_a = (t.to(dtype) for t in situ_inputs(0))
    ref = exact(grad_a, h, u)
    assert_close_to_exact("a (forward)", situ_glu_forward(h, u), ref["a"])
    for name, got in zip(("grad_h", "grad_u", "a"), situ_glu_backward(grad_a, h, u), strict=True):
        assert_close_to_exact(name, got, ref[name])


def test_autograd_op_gives_the_one_pass_gradients() -> None:
    h, u, grad_a = situ_inputs(1, 9, 40)
    h.requires_grad_()
    u.requires_grad_()
    a = situ_glu(h, u)
    a.backward(grad_a)
    ref = exact(grad_a, h.detach(), u.detach())
    assert_close_to_exact("a", a.detach(), ref["a"])
    assert_close_to_exact("grad_h", h.grad, ref["grad_h"])
    assert_close_to_exact("grad_u", u.grad, ref["grad_u"])
    with pytest.raises(ValueError, match="one shape and dtype"):
        situ_glu(h, u.float())
