"""parallel.dense=plain against FSDP2 at world size 1: the same training, bit for bit.

The K3 block (KDA, MLA, AttnRes, SiTU-GLU, latent MoE on moonep) in bf16 compute on the CPU, 2 accumulated
passes per step, global-norm clipping and QK-Clip active: losses, grad norms and every parameter, router
bias and optimizer state tensor equal after 3 steps, for AdamW and Muon. Checkpoints cross-load bitwise
between the two (world 1 both ways, and a plain checkpoint into FSDP at world 2). Each FSDP run needs a
process group: one spawned gloo rank (tests/dist_utils.run_ranks).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moontrain.config import RunConfig
from moontrain.parallel.layout import build_layout
from moontrain.parallel.plain_dense import PlainDense
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config

CPU = torch.device("cpu")


def _config(dense: str, optim: str, run_dir: str, *, compile_: bool = False) -> RunConfig:
    cfg = small_config("moonep", 1, run_dir=run_dir, k3_block=True)
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, dense=dense, compute_dtype="bfloat16"),
        # grad_clip well under the grad norm (~1), QK-Clip's tau under the max logits: both clip every step
        optim=dataclasses.replace(cfg.optim, name=optim, grad_clip=0.05, qk_clip_tau=0.04),
        train=dataclasses.replace(cfg.train, micro_batch_size=2, compile=compile_),
    )


def _run(dense: str, optim: str, run_dir: str, steps: int = 3) -> tuple[list[float], list[float], dict, float]:
    torch.manual_seed(0)
    trainer = Trainer(_config(dense, optim, run_dir), build_layout(1, CPU))
    assert trainer.accumulation_steps == 2
    losses, norms, clipped_heads = [], [], 0.0
    for _ in range(steps):
        stats = trainer.train_step()
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        clipped_heads += stats.scalars["qk/clipped_heads/total"]
    state = full_state(trainer)
    trainer.close()
    return losses, norms, state, clipped_heads


def _plain_vs_fsdp(rank: int, world: int, optim: str, run_dir: str) -> tuple:
    torch.set_num_threads(1)
    return _run("fsdp", optim, run_dir), _run("plain", optim, run_dir)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_plain_equals_fsdp_at_world_1(tmp_path: Path, optim: str) -> None:
    fsdp, plain = run_ranks(_plain_vs_fsdp, 1, optim, str(tmp_path))[0]
    f_losses, f_norms, f_state, f_clipped = fsdp
    p_losses, p_norms, p_state, p_clipped = plain
    assert f_clipped > 0 and p_clipped == f_clipped, f"QK-Clip must clip heads: {p_clipped}, {f_clipped}"
    assert min(f_norms) > 0.05, f"clipping must be active (grad_clip 0.05), grad norms {f_norms}"
    assert p_losses == f_losses, (p_losses, f_losses)
    assert p_norms == f_norms, (p_norms, f_norms)
    assert_bitwise(p_state, f_state, f"plain vs fsdp ({optim})")


class _Block(torch.nn.Module):
    """Reads the shared state b twice (as AttnRes blocks read the completed blocks) and an fp32 table."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(d))
        self.w2 = torch.nn.Parameter(torch.randn(d))

    def forward(self, b: torch.Tensor, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        assert table.dtype == b.dtype  # cast to the compute dtype on the way in
        return x + (b * self.w1).tanh() * table + (b * self.w2).sigmoid()


class _Toy(torch.nn.Module):
    def __init__(self, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(d))
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(layers))
        self.table = torch.linspace(0.5, 1.5, d)

    def forward(self, scale: float) -> torch.Tensor:
        b = self.embed * scale
        x = b
        for block in self.layers:
            x = block(b, x, self.table)
        return (x.float() ** 2).sum()


def _toy_grads(rank: int, world: int) -> tuple[dict, dict]:
    def grads(dense: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = _Toy()
        if dense == "fsdp":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            model.set_requires_gradient_sync(False)
        else:
            plain = PlainDense(model, torch.bfloat16)
        for i, scale in enumerate((1.0, 0.5)):
            if dense == "fsdp":
                model.set_requires_gradient_sync(i == 1)
            model(scale).backward()
            if dense == "plain":
                plain.accumulate_grads()
        if dense == "plain":
            plain.reshard()
        return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                for n, p in model.named_parameters()}

    return grads("fsdp"), grads("plain")


def test_block_inputs_cast_and_grouped_as_fsdp_does() -> None:
    """A state read twice by every block, an fp32 input, bf16 compute, two passes: the fp32 grads equal
    FSDP2's bit for bit (its input casts and its one autograd node per block's inputs set the values)."""
    fsdp, plain = run_ranks(_toy_grads, 1)[0]
    assert_bitwise(plain, fsdp, "toy plain vs fsdp")
    assert all(g.dtype == torch.float32 for g in plain.values())
