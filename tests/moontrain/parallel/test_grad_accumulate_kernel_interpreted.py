"""moontrain.parallel.grad_accumulate_kernel in Triton's interpreter on the CPU: every accumulator equals the
PyTorch path's value (the grad widened exactly, added in fp32, rounded once) bit for bit, for tensors smaller
than, equal to and larger than a chunk; and parallel.dense=plain with parallel.plain_accumulate=triton
accumulates a multi-pass step's grads to the same bits as the foreach path."""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and skips this module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.parallel import grad_accumulate_kernel as k
from moontrain.parallel import plain_dense
from moontrain.parallel.plain_dense import PlainDense
from tests.moontrain.parallel.test_plain_dense import _Toy


def test_chunk_table_covers_every_element_once() -> None:
    assert k.chunk_table([5, 8, 1, 9], block=4).tolist() == [[0, 0], [0, 4], [1, 0], [1, 4], [2, 0], [3, 0],
                                                           [3, 4], [3, 8]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accumulators_equal_the_widened_sums(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(k, "BLOCK", 64)
    gen = torch.Generator().manual_seed(3)
    shapes = [(3, 5), (64,), (200, 3), (1,), (129,)]  # under, at and over a 64-element chunk
    accs = [torch.randn(s, generator=gen) * 100 for s in shapes]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    want = [a + g.float() for a, g in zip(accs, grads, strict=True)]
    acc = k.GradAccumulator()
    acc.add_(accs, grads)
    for i, (got, w) in enumerate(zip(accs, want, strict=True)):
        assert torch.equal(got, w), i
    acc.add_(accs, grads)  # the cached chunk table, new addresses
    for i, (got, w) in enumerate(zip(accs, want, strict=True)):
        assert torch.equal(got, w + grads[i].float()), i


def test_bad_lists_are_refused() -> None:
    acc = k.GradAccumulator()
    with pytest.raises(ValueError, match="2 accumulators but 1 grads"):
        acc.add_([torch.zeros(2), torch.zeros(2)], [torch.zeros(2)])
    with pytest.raises(ValueError, match="share one dtype"):
        acc.add_([torch.zeros(2), torch.zeros(2)], [torch.zeros(2).bfloat16(), torch.zeros(2).half()])
    with pytest.raises(ValueError, match=r"pair 0: accumulator torch\.bfloat16"):
        acc.add_([torch.zeros(2).bfloat16()], [torch.zeros(2).bfloat16()])
    with pytest.raises(ValueError, match=r"pairs \[0\] start off a 16-byte boundary"):
        acc.add_([torch.zeros(9)[1:]], [torch.zeros(8).bfloat16()])
    with pytest.raises(ValueError, match=r"pair 0: .*contiguous False"):
        acc.add_([torch.zeros(4, 2).t()], [torch.zeros(2, 4).bfloat16()])


def test_plain_dense_triton_accumulates_as_the_foreach_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four passes (one parameter without a grad in the third): the masters' grads after reshard are bitwise
    those of the foreach path."""
    monkeypatch.setattr(k, "BLOCK", 32)
    monkeypatch.setattr(plain_dense, "SCRATCH_BYTES", 4 * 64 * 2)

    def grads(accumulate: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Toy(d=64, layers=3)
        plain = PlainDense(model, torch.bfloat16, accumulate)
        assert (plain.accumulator is not None) == (accumulate == "triton")
        for step_pass, scale in enumerate((1.0, 0.5, 2.0, 0.25)):
            model(scale).backward()
            if step_pass == 2:
                plain.compute[1].grad = None
            plain.accumulate_grads()
        plain.reshard()
        return [m.grad.clone() for m in plain.masters]

    for i, (a, b) in enumerate(zip(grads("triton"), grads("torch"), strict=True)):
        assert torch.equal(a, b), i
