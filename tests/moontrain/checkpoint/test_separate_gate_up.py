"""Checkpoints saved while the experts' gate and up were separate projections (`...experts.master.gate` and
`...up`, and their optimizer states) read as today's gate_up [E, H, 2F]: the column halves, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moontrain.checkpoint.tensors import CheckpointError, Piece, TensorSource, separate_gate_up_names

MASTER = "model.layers.1.ffn.experts.master."


def _source(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> TensorSource:
    """Two files, rows [0, 3) and [3, 5) of every tensor (a checkpoint saved at EP = 2)."""
    save_file({n: t[:3].contiguous() for n, t in tensors.items()}, str(tmp_path / "a.safetensors"))
    save_file({n: t[3:].contiguous() for n, t in tensors.items()}, str(tmp_path / "b.safetensors"))
    index = {n: (tuple(t.shape), [Piece("a.safetensors", 0, 3), Piece("b.safetensors", 3, 2)])
             for n, t in tensors.items()}
    return TensorSource(tmp_path, index)


def test_separate_halves_read_as_gate_up(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    saved = {f"{MASTER}gate": torch.randn(5, 4, 6, generator=gen), f"{MASTER}up": torch.randn(5, 4, 6, generator=gen),
             f"optim.{MASTER}gate.exp_avg": torch.randn(5, 4, 6, generator=gen),
             f"optim.{MASTER}up.exp_avg": torch.randn(5, 4, 6, generator=gen)}
    source = _source(tmp_path, saved)
    step = torch.tensor(7.0)
    save_file({f"optim.{MASTER}gate.step": step, f"optim.{MASTER}up.step": step.clone()}, str(tmp_path / "c.safetensors"))
    source.index.update({f"optim.{MASTER}{half}.step": ((), [Piece("c.safetensors", 0, 0)]) for half in ("gate", "up")})
    for prefix, suffix in (("", ""), ("optim.", ".exp_avg")):
        name = f"{prefix}{MASTER}gate_up{suffix}"
        want = torch.cat([saved[f"{prefix}{MASTER}gate{suffix}"], saved[f"{prefix}{MASTER}up{suffix}"]], dim=2)
        assert source.shape(name) == (5, 4, 12)
        assert torch.equal(source.full(name), want)
        assert torch.equal(source.rows(name, 2, 2), want[2:4])  # across the two files
        out = torch.empty(3, 4, 12)
        source.read_into(name, 1, 3, out)
        assert torch.equal(out, want[1:4])
    assert source.shape(f"optim.{MASTER}gate_up.step") == ()  # Adam's step: one value for both halves
    assert torch.equal(source.full(f"optim.{MASTER}gate_up.step"), step)
    assert separate_gate_up_names(f"optim.{MASTER}gate_up.momentum_buffer") == (
        f"optim.{MASTER}gate.momentum_buffer", f"optim.{MASTER}up.momentum_buffer")
    assert source.shape(f"optim.{MASTER}gate_up.step") == ()  # Adam's step: one value for both halves
    assert torch.equal(source.full(f"optim.{MASTER}gate_up.step"), step)
    assert separate_gate_up_names(f"{MASTER}down") is None


def test_one_half_missing_is_named(tmp_path: Path) -> None:
    source = _source(tmp_path, {f"{MASTER}gate": torch.zeros(5, 4, 6)})
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.1\.ffn\.experts\.master\.gate_up'"):
        source.full(f"{MASTER}gate_up")
