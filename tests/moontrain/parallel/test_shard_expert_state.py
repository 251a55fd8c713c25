"""Expert state sharded over the dp_replicate replicas (parallel.shard_expert_state) == unsharded, bitwise:
losses, grad norms, parameters (the sharded fp32 masters gathered), expert compute copies, router biases and
Adam state after a few steps, at world 4 = dp_replicate 2 x EP 2 (alltoall and moonep) and world 2 =
dp_replicate 2 x EP 1 (local); checkpoints saved sharded resume unsharded and the reverse, bitwise against a
run without interruption (the sharded masters and moments are saved as canonical rows under the master's
name). At dp_replicate 4 (gloo): the reduce-scatter gives each replica the all-reduce's sums of its rows,
bitwise, without any all-reduce of the expert grads; the global grad norm from the shards equals the one from
the whole grads bitwise and a float64 reference within fp32 rounding; the sharded masters init their own rows
and the compute rows all-gathered from them equal the unsharded ones. A layout whose local experts the
replicas cannot split is rejected; the dry-run counts the sharded masters and moments.

Reference: the same run unsharded (each element's AdamW update is elementwise, so the shard's step must equal
the whole tensor's rows bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moontrain.model.experts.weights import PROJECTIONS, ExpertWeights
from moontrain.model.params import count_params
from moontrain.optim.adamw import build_optimizer
from moontrain.optim.config import OptimConfig
from moontrain.parallel.clip import global_grad_norm
from moontrain.parallel.layout import build_layout
from moontrain.planning.memory import estimate_memory
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import _full, assert_bitwise, full_state, small_config

CPU = torch.device("cpu")


def _trainer(backend: str, ep: int, shard: bool, run_dir: str, device: torch.device) -> Trainer:
    cfg = small_config(backend, ep, steps=4, run_dir=run_dir)
    cfg.parallel.shard_expert_state = shard
    cfg.optim.write_back = False  # the sharded state is built for plain AdamW (write_back follows fused on a GPU)
    cfg.train.deterministic = device.type == "cuda"
    return Trainer(cfg, build_layout(ep, device))


def _canonical(trainer: Trainer) -> dict[str, torch.Tensor]:
    """full_state, the sharded masters and their Adam moments gathered over the replicas into canonical rows,
    and every expert compute copy (the rows the GEMMs read)."""
    out = full_state(trainer)
    layout = trainer.layout
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for w in trainer.experts:
        for proj, master in w.master.items():
            name = names[id(master)]
            out[f"{name}.compute"] = _full(trainer, name, w.compute[proj])
            if not w.sharded:
                continue
            state = trainer.optimizer.state.get(master, {})
            for key, value in {name: master.detach(), **{f"{name}.{k}": v for k, v in state.items() if v.ndim}}.items():
                assert value.shape[0] == w.num_local // layout.dp_replicate, (key, value.shape)
                parts = [torch.empty_like(value) for _ in range(layout.dp_replicate)]
                dist.all_gather(parts, value.contiguous(), group=layout.edp_group)
                out[key] = _full(trainer, name, torch.cat(parts))
    return out


def train(trainer: Trainer, steps: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of each step."""
    out = []
    for _ in range(steps):
        stats = trainer.train_step()
        assert stats is not None  # log_every=1
        out.append((stats.loss, stats.grad_norm))
    return out


def sharded_vs_unsharded(rank: int, world: int, backend: str, ep: int, run_dir: str,
                         device: torch.device = CPU) -> None:
    """The whole comparison on one rank (every rank calls it; run_dir shared by the ranks)."""
    torch.set_num_threads(1)
    states, losses = {}, {}
    for shard in (False, True):
        trainer = _trainer(backend, ep, shard, f"{run_dir}/{shard}", device)
        assert trainer.experts[0].sharded == shard
        rows = trainer.experts[0].num_local // (trainer.layout.dp_replicate if shard else 1)
        assert trainer.experts[0].master["gate_up"].shape[0] == rows
        losses[shard] = train(trainer, 2)
        trainer.save_checkpoint()
        losses[shard] += train(trainer, 1)
        states[shard] = _canonical(trainer)
        trainer.close()
    assert losses[True] == losses[False], losses
    assert max(norm for _, norm in losses[False]) > 1.0, losses  # optim.grad_clip acts: the step reads the norm
    assert any(k.endswith("experts.master.gate_up.exp_avg_sq") for k in states[False])
    assert_bitwise(states[True], states[False], "sharded expert state vs unsharded")
    for shard in (False, True):  # resume the other setting's checkpoint
        trainer = _trainer(backend, ep, shard, f"{run_dir}/resume{shard}", device)
        trainer.load_checkpoint(sorted(Path(f"{run_dir}/{not shard}/checkpoints").iterdir())[-1])
        resumed = train(trainer, 1)
        assert resumed == losses[False][2:], (shard, resumed, losses[False])
        assert_bitwise(_canonical(trainer), states[False], f"resumed shard_expert_state={shard}")
        trainer.close()


@pytest.mark.parametrize(("world", "backend", "ep"), [(4, "alltoall", 2), (4, "moonep", 2), (2, "local", 1)])
def test_sharded_equals_unsharded_and_resumes(tmp_path: Path, world: int, backend: str, ep: int) -> None:
    run_ranks(sharded_vs_unsharded, world, backend, ep, str(tmp_path), timeout_s=600.0)


def test_rejects_indivisible_local_experts() -> None:
    w = ExpertWeights(num_experts=6, ep_rank=0, ep=2, hidden=4, intermediate=8)
    with pytest.raises(ValueError, match=r"3 local experts per EP rank over dp_replicate=2"):
        w.shard_state(0, 2, None)


@pytest.mark.parametrize(("optim", "match"), [({"name": "muon"}, "built for AdamW only"),
                                               ({"write_back": True}, "not built for the fused write-back AdamW")])
def test_refuses_unbuilt_optimizers(optim: dict, match: str) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=match):
        build_optimizer(model, OptimConfig(**optim), 4, shard_expert_state=True)


def _reduce_at_four_replicas(rank: int, world: int) -> None:
    """dp_replicate 4 x EP 1: the same per-rank grads reduced unsharded and sharded."""
    layout = build_layout(1, CPU)
    assert layout.dp_replicate == world == 4
    weights = {}
    for shard in (False, True):
        w = ExpertWeights(num_experts=8, ep_rank=0, ep=1, hidden=6, intermediate=10)
        w.bind_owned(torch.float32, 1.0)
        gen = torch.Generator().manual_seed(100 + rank)  # each replica its own grads, wide magnitudes
        for name in PROJECTIONS:
            w.grad[name].copy_(torch.randn(w.grad[name].shape, generator=gen)
                               * torch.logspace(-4, 4, w.grad[name].shape[-1]))
        if shard:
            w.shard_state(layout.dp_replicate_rank, layout.dp_replicate, layout.edp_group)
        weights[shard] = w
    whole = {name: weights[False].grad[name].clone() for name in PROJECTIONS}
    parts = {name: [torch.empty_like(g) for _ in range(world)] for name, g in whole.items()}
    for name, g in whole.items():
        dist.all_gather(parts[name], g)

    all_reduce = dist.all_reduce
    dist.all_reduce = None  # sharded: the expert grads must not be all-reduced
    try:
        weights[True].reduce_grads(layout.edp_group)
    finally:
        dist.all_reduce = all_reduce
    weights[False].reduce_grads(layout.edp_group)
    norms = {}
    for shard, w in weights.items():
        w.attach_grads()
        norms[shard] = global_grad_norm([], list(w.master.values()), layout, experts_sharded=shard)
    rows = slice(rank * 2, rank * 2 + 2)  # epn 8 over 4 replicas
    for name in PROJECTIONS:
        got, want = weights[True].master[name].grad, weights[False].grad[name][rows]
        assert torch.equal(got, want), (name, (got != want).nonzero()[0].tolist())
        terms = torch.stack(parts[name]).double()[:, rows]
        bound = (world - 1) * 2.0**-24 * terms.abs().sum(0)  # fp32 sum of `world` terms, any order
        assert ((got.double() - terms.sum(0)).abs() <= bound).all(), name
    assert torch.equal(norms[True], norms[False]), (norms[True].item(), norms[False].item())
    for w in weights.values():  # the sharded masters init their own rows; push_master all-gathers the compute rows
        w.init_master(seed=3, layer_idx=1, stds=dict.fromkeys(("gate", "up", "down"), 0.02))
        w.push_master()
    for name in PROJECTIONS:
        assert torch.equal(weights[True].master[name], weights[False].master[name][rows]), name
        assert torch.equal(weights[True].compute[name], weights[False].compute[name]), name
    reduced = [weights[False].grad[n].double() for n in PROJECTIONS]  # the fp32 sums, checked above
    exact = sum(g.square().sum() for g in reduced).sqrt()
    numel = sum(g.numel() for g in reduced)  # fp32 sum of numel squares, worst-case order
    assert abs(norms[True].double() - exact) <= numel * 2.0**-24 * exact, (norms[True].item(), exact.item())


def test_reduce_scatter_and_grad_norm_at_four_replicas() -> None:
    run_ranks(_reduce_at_four_replicas, 4, timeout_s=120.0)


def test_dry_run_counts_sharded_moments() -> None:
    cfg = small_config("alltoall", 2)
    counts = count_params(cfg.model)
    whole = estimate_memory(cfg, counts, 8, 4)
    cfg.parallel.shard_expert_state = True
    sharded = estimate_memory(cfg, counts, 8, 4)
    m = cfg.model
    local = m.num_moe_layers * (m.num_experts // 2) * 3 * m.expert_width * m.moe_intermediate_size
    assert whole.experts["optimizer"] == 8 * local and sharded.experts["optimizer"] == 8 * local / 4
    assert whole.experts["master"] == 4 * local and sharded.experts["master"] == 4 * local / 4
    for row in ("weights", "grads"):
        assert sharded.experts[row] == whole.experts[row]
