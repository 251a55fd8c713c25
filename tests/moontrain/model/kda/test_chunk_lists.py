"""moontrain.model.kda.chunk_lists: fla's device chunk lists made once per sequence-bounds tensor, bit for bit fla's
own (prepare_chunk_indices_static, pure PyTorch: runs on the CPU), and made anew where the tensor changes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

index = pytest.importorskip("fla.ops.utils.index", reason="needs fla-core (pip install fla-core==0.6.0)")

from moontrain.model.kda.chunk_lists import share_with_fla, static_chunk_lists  # noqa: E402

CHUNK = 64


def _bounds(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _nt_max(cu: torch.Tensor) -> int:
    """fla's chunk_kda's bound: chunks of the flat row plus one partial chunk per further sequence."""
    return -(-int(cu[-1]) // CHUNK) + cu.numel() - 2


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lengths", [(4096,), (1000, 3096), (64, 1, 63, 4000, 4096), (1024,) * 16])
def test_lists_are_flas_bitwise(lengths: tuple[int, ...]) -> None:
    cu = _bounds(*lengths)
    got = static_chunk_lists(cu, CHUNK, _nt_max(cu))
    want = index.prepare_chunk_indices_static(cu_seqlens=cu.clone(), chunk_size=CHUNK, nt_max=_nt_max(cu))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int((got[0][:, 0] >= 0).sum()) == sum(-(-n // CHUNK) for n in lengths)


def test_made_once_per_tensor_and_anew_when_it_changes() -> None:
    """Twelve calls (a forward's KDA layers) issue the ops of one; a tensor of equal values is another key (the
    memo lives on the tensor); an in-place change or another bound makes the lists again, correct for it."""
    cu = _bounds(1000, 3096)
    nt_max = _nt_max(cu)
    with _Ops() as ops:
        first = static_chunk_lists(cu, CHUNK, nt_max)
    once = ops.count
    with _Ops() as ops:
        again = [static_chunk_lists(cu, CHUNK, nt_max) for _ in range(11)]
    assert once >= 10 and ops.count == 0 and all(a is first for a in again)
    other = static_chunk_lists(cu.clone(), CHUNK, _nt_max(cu))
    assert other is not first and all(torch.equal(a, b) for a, b in zip(other, first, strict=True))
    cu[1] = 2000  # the documents move: 2000 + 2096
    moved = static_chunk_lists(cu, CHUNK, _nt_max(cu))
    want = index.prepare_chunk_indices_static(cu_seqlens=cu.clone(), chunk_size=CHUNK, nt_max=_nt_max(cu))
    assert moved is not first and all(torch.equal(a, b) for a, b in zip(moved, want, strict=True))
    wider = static_chunk_lists(cu, CHUNK, _nt_max(cu) + 3)
    assert wider[0].shape[0] == _nt_max(cu) + 3 and bool((wider[0][-3:, 0] == -1).all())


def test_fla_chunk_kda_takes_the_shared_lists() -> None:
    fla_chunk = pytest.importorskip("fla.ops.kda.chunk")
    share_with_fla()
    assert fla_chunk.prepare_chunk_indices_static is static_chunk_lists
