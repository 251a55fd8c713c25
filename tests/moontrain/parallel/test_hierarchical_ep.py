"""Hierarchical EP through the trainer: parallel.ep=8 over parallel.ep_hosts=2 (2 "hosts" x 4 gloo ranks,
one CPU symmetric heap per host) trains the 2-layer model of test_ep_equality 3 steps to the single-process
reference's losses, grad norms, step-1 gradients, parameters and router biases, within that test's derived
tolerance (20x the fp32 noise of reordering the batch). Bitwise does not hold here: in fp32 the host
combine sums a token's per-host partials, which reassociates the sum of its K expert outputs, and each
expert's weight-grad rows are grouped differently; the layer-level bitwise statements are in
tests/moonep/test_hierarchical.py. Bad layouts are config errors (below).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moontrain.config import RunConfig, from_dict
from moontrain.parallel.hosts import check_ep_domain
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.parallel.test_ep_equality import _check, _reference, _train, tiny_config


def train_hierarchical(rank: int, world: int, ep_hosts: int) -> tuple:
    cfg = tiny_config("moonep", world)
    cfg.parallel = dataclasses.replace(cfg.parallel, ep_hosts=ep_hosts)
    trainer = Trainer(cfg, build_layout(world, torch.device("cpu"), ep_hosts))
    backend = trainer.model.moe_layers()[0].backend
    assert backend.hier is not None and backend.buf.num_ranks == world // ep_hosts
    slots_used = []
    prefetch = backend.pools.prefetch

    def recording_prefetch(plan, layer) -> None:
        slots_used.append(int((plan.slot_expert_RB >= 0).sum()))
        prefetch(plan, layer)

    backend.pools.prefetch = recording_prefetch
    losses, maxvio, state = _train(trainer)
    trainer.close()
    state["slots_used"] = torch.tensor(slots_used)
    state["fsdp_gathers"] = torch.tensor(0)
    return losses, maxvio, state


@pytest.mark.slow
def test_hierarchical_training_matches_single_process() -> None:
    result = run_ranks(train_hierarchical, 8, 2, timeout_s=300)[0]
    assert result[2]["slots_used"].sum() > 0, "the skewed router should make moonep use redundant experts in a host"
    _check(result, _reference(k3_block=False))


def _run_config(**parallel) -> RunConfig:
    cfg = tiny_config("moonep", 8)
    return from_dict(RunConfig, {"model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
                                 "experts": {"backend": parallel.pop("backend", "moonep")},
                                 "parallel": {"ep": 8, **parallel}})


def test_bad_hierarchical_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"parallel.ep_hosts=3 must be >= 1 and divide parallel.ep=8"):
        _run_config(ep_hosts=3)
    with pytest.raises(ValueError, match=r"parallel.ep_hosts=0 must be >= 1"):
        _run_config(ep_hosts=0)
    with pytest.raises(ValueError, match=r"hierarchical expert parallelism, built on the moonep backend"):
        _run_config(ep_hosts=2, backend="alltoall").check_world(8)
    with pytest.raises(ValueError, match=r"no Triton kernels yet; set experts.moonep.kernels=auto"):
        cfg = _run_config(ep_hosts=2)
        cfg.experts.moonep = dataclasses.replace(cfg.experts.moonep, kernels="triton")
        cfg.check_world(8)
    _run_config(ep_hosts=2).check_world(8)
    check_ep_domain("moonep", 16, 8, ep_hosts=2)  # 8 ranks per host: fits H200 hosts
    check_ep_domain("moonep", 16, 4, ep_hosts=4)
    with pytest.raises(ValueError, match=r"puts 8 ranks of the EP group on each host, which does not divide the 4"):
        check_ep_domain("moonep", 16, 4, ep_hosts=2)
    with pytest.raises(ValueError, match=r"set parallel.ep_hosts to the hosts it spans"):
        check_ep_domain("moonep", 16, 8)
