"""The expert-grad contract every backend relies on (moonep's grad mirror in particular), first on an
emulated mirror, then on the real moonep pools in a dp_replicate 2 x EP 2 run:

the expert-data-parallel reduction is handed exactly this rank's local rows, never the slot rows
[E, E+B) of a grad mirror. The mirror is emulated here as in docs/moonep.md §4.3: one fp32 tensor
[E+B, Hin, Hout] whose rows [r*epn, (r+1)*epn) are this rank's local grads (bound as the grad view) and
whose rows [E, E+B) are the reduce buffer. The reduce buffer is poisoned with NaN before the reduction;
the reduced local rows must equal the exact sum (the grads carry the loss scale already), the poison
must stay where it was, and every tensor given to all_reduce must be exactly a local-row view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from moontrain.model.experts import ExpertWeights
from tests.dist_utils import run_ranks

E, H, FF, EP = 4, 16, 32, 1  # one EP rank per replica, two replicas: the EDP group is the whole world


@contextlib.contextmanager
def recorded_all_reduce() -> Iterator[list[tuple[int, tuple[int, ...]]]]:
    """Record (data_ptr, shape) of every tensor given to dist.all_reduce inside the block."""
    given: list[tuple[int, tuple[int, ...]]] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        given.append((tensor.data_ptr(), tuple(tensor.shape)))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        yield given
    finally:
        dist.all_reduce = real_all_reduce


def _local_grad(rank: int, e: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float(10 * rank + e))


def _rank_fn(rank: int, world: int) -> dict:
    w = ExpertWeights(num_experts=E, ep_rank=0, ep=EP, hidden=H, intermediate=FF)
    w.init_master(seed=0, layer_idx=0, stds=dict.fromkeys(("gate", "up", "down"), 0.02))
    epn, slots = w.num_local, w.num_local
    mirrors, compute = {}, {}
    for name, shape in w.shapes.items():
        mirror = torch.zeros(E + slots, *shape)
        for e in range(E):
            mirror[e] = _local_grad(rank, e, shape)
        mirror[E:] = float("nan")  # the reduce buffer: must never enter a DP reduction
        mirrors[name] = mirror
        compute[name] = torch.empty(epn, *shape, dtype=torch.bfloat16)
    w.bind_external(compute, {n: m[:epn] for n, m in mirrors.items()})
    with recorded_all_reduce() as given:
        w.reduce_grads(dist.group.WORLD)
    w.attach_grads()
    local_ptrs = {(m[:epn].data_ptr(), tuple(m[:epn].shape)) for m in mirrors.values()}
    return {"mirrors": mirrors, "given": given, "local": local_ptrs,
            "master_grad_is_view": all(w.master[n].grad.data_ptr() == mirrors[n].data_ptr() for n in mirrors),
            "compute_matches_master": all(torch.equal(compute[n], w.master[n].detach().bfloat16()) for n in mirrors)}


def test_dp_reduction_sees_local_rows_only() -> None:
    results = run_ranks(_rank_fn, 2, timeout_s=300)
    for rank, res in enumerate(results):
        assert sorted(res["given"]) == sorted(res["local"]), f"rank {rank}: all_reduce got {res['given']}"
        assert res["master_grad_is_view"] and res["compute_matches_master"]
        for name, mirror in res["mirrors"].items():
            for e in range(E):
                want = torch.full_like(mirror[e], (0 + e) + (10 + e))  # the sum over the two replicas
                assert torch.equal(mirror[e], want), f"rank {rank} {name} row {e}: {mirror[e].flatten()[0]}"
            assert torch.isnan(mirror[E:]).all(), f"rank {rank} {name}: slot rows were touched"


def test_bind_external_rejects_wrong_views() -> None:
    w = ExpertWeights(num_experts=E, ep_rank=0, ep=2, hidden=H, intermediate=FF)
    good = {n: torch.zeros(2, *s) for n, s in w.shapes.items()}
    bad = dict(good, gate_up=torch.zeros(3, H, 2 * FF))
    with pytest.raises(ValueError, match=r"'gate_up': backend views \(2, 16, 64\) / \(3, 16, 64\) do not match "
                                         r"the local rows' shape \(2, 16, 64\)"):
        w.bind_external(good, bad)


def _moonep_rank_fn(rank: int, world: int) -> dict:
    """dp_replicate 2 x EP 2 with the real moonep pools: poison the reduce pool after backward (moonep's
    reduce_grad has consumed it), then run the trainer's expert-data-parallel reduction."""
    from torch.distributed.tensor import DTensor

    from moontrain.parallel.layout import build_layout
    from moontrain.trainer.trainer import Trainer
    from tests.moontrain.parallel.test_ep_equality import SKEW, tiny_config

    trainer = Trainer(tiny_config("moonep", 2), build_layout(2, torch.device("cpu")))
    for moe in trainer.model.moe_layers():
        moe.router.score_bias_E[:2] += SKEW
    tokens, targets = trainer.data.batch(0)
    loss, _ = trainer.model(tokens, targets)
    loss.backward()
    layers = [moe.backend.layer for moe in trainer.model.moe_layers()]
    num_experts = trainer.cfg.model.num_experts
    before = {}
    for i, layer in enumerate(layers):
        for name in layer.g_local:
            before[(i, name)] = layer.g_local[name].clone()
            layer.g_full[name][num_experts:] = float("nan")  # the reduce pool: rows [E, E+B)
    with recorded_all_reduce() as given:
        trainer._reduce_grads()
    edp = trainer.layout.edp_group
    expected, reduced, poison_kept = {}, {}, True
    for (i, name), g in before.items():
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(edp))]
        dist.all_gather(parts, g, group=edp)
        # the backward accumulated the grads pre-scaled by the loss-mean factor 1 / world (ExpertsContext.
        # loss_scale), so the reduction only sums the replicas
        expected[(i, name)] = parts[0] + parts[1]
        reduced[(i, name)] = layers[i].g_local[name].clone()
        poison_kept &= bool(torch.isnan(layers[i].g_full[name][num_experts:]).all())
    local_views = {(layer.g_local[n].data_ptr(), tuple(layer.g_local[n].shape)) for layer in layers for n in layer.g_local}
    masters_plain = all(not isinstance(p, DTensor) for p in trainer.expert_params)
    loss_scale = trainer.experts_ctx.loss_scale == 1.0 / dist.get_world_size() == trainer.model.moe_layers()[0].backend.pools.wgrad_scale
    master_grads_are_views = all(
        moe.experts.master[n].grad.data_ptr() == layer.g_local[n].data_ptr()
        for moe, layer in zip(trainer.model.moe_layers(), layers, strict=True) for n in layer.g_local)
    trainer.close()
    return {"given": given, "local_views": local_views, "expected": expected, "reduced": reduced,
            "poison_kept": poison_kept, "masters_plain": masters_plain, "views": master_grads_are_views,
            "loss_scale": loss_scale}


def test_moonep_reduce_pool_never_reaches_dp_reduction() -> None:
    for rank, res in enumerate(run_ranks(_moonep_rank_fn, 4, timeout_s=300)):
        assert sorted(res["given"]) == sorted(res["local_views"]), f"rank {rank}: all_reduce got {res['given']}"
        assert res["poison_kept"], f"rank {rank}: the reduce pool was written by the DP reduction"
        assert res["masters_plain"], "expert masters must not be FSDP (DTensor) parameters"
        assert res["views"], "master.grad must be moonep's g_local view"
        assert res["loss_scale"], "moonep's weight grads must accumulate times the context's loss scale"
        for key, want in res["expected"].items():
            got = res["reduced"][key]
            assert torch.isfinite(got).all() and torch.equal(got, want), f"rank {rank} layer/proj {key}"


def test_owned_weights_are_freed_when_dropped() -> None:
    """The fold hook sits on the compute leaf (held in C++); a strong reference from it back to its
    ExpertWeights would be a cycle the garbage collector cannot see, and every Trainer built in one
    process (a benchmark's points) would stay in memory."""
    import gc
    import weakref

    w = ExpertWeights(num_experts=E, ep_rank=0, ep=1, hidden=H, intermediate=FF)
    w.bind_owned(torch.float32, loss_scale=0.5)
    loss = sum((c * 1.0).sum() for c in w.compute.values())
    loss.backward()  # the hook runs: grad = 0.5 * ones
    assert all(torch.equal(g, torch.full_like(g, 0.5)) for g in w.grad.values())
    module, leaf = weakref.ref(w), weakref.ref(w.compute["gate_up"])
    del w, loss
    gc.collect()
    assert module() is None and leaf() is None, "ExpertWeights kept alive by its own fold hook"
