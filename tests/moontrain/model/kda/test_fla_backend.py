"""moontrain.model.kda.fla_backend: fla's dispatched KDA backward stages (what fla's chunk_kda_bwd calls) reach
moontrain's launchers with fla's keyword arguments while routed, calls a kernel cannot take are left to fla's by
the verifiers, and unrouted the backend answers nothing. The launchers are replaced by recorders: no kernel
runs, so it is a CPU test (skipped where fla-core, which the test extra installs, is absent)."""

from __future__ import annotations

import pytest
import torch

from moontrain.model.kda import dqkg as kda_dqkg
from moontrain.model.kda import intra as kda_intra


@pytest.fixture
def backend():
    pytest.importorskip("fla.ops.kda.chunk_bwd", reason="needs fla-core (pip install fla-core==0.6.0)")
    from moontrain.model.kda.fla_backend import _fla_backend, route_fla_stages

    yield _fla_backend()
    route_fla_stages(dqkg="fla", intra="fla")


def test_dqkg_stage_routes(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    from moontrain.model.kda import dqkg_kernel as kda_dqkg_kernel
    from moontrain.model.kda.fla_backend import route_fla_stages

    calls = []
    monkeypatch.setattr(kda_dqkg_kernel, "kda_dqkg", lambda **kw: calls.append(kw) or ("ours",))
    inputs = kda_dqkg.random_stage_inputs(1, 64, 2, 32, 32, torch.float32, "cpu", seed=0)
    route_fla_stages(dqkg="moontrain", intra="fla")
    assert chunk_kda_bwd_wy_dqkg_fused(**inputs) == ("ours",)
    assert len(calls) == 1 and calls[0].keys() == inputs.keys()
    assert all(calls[0][name] is x for name, x in inputs.items())
    grouped = dict(inputs, v=torch.cat([inputs["v"]] * 2, dim=2))
    accepted, why = backend().verify("chunk_kda_bwd_wy_dqkg_fused", **grouped)
    assert not accepted and "grouped value heads" in why
    accepted, why = backend().verify("chunk_kda_bwd_intra", **kda_intra.random_stage_inputs(
        1, 64, 2, 32, torch.float32, "cpu", seed=0))
    assert not accepted and why == "kernels.kda_intra=fla"
    route_fla_stages(dqkg="fla", intra="fla")
    assert not backend().is_enabled()


def test_intra_stage_routes(backend) -> None:
    """fla_k64 runs fla's own kernel, so its verifier takes every call fla's wrapper takes (the call reaching the
    launch: test_intra_fla_interpreted.py); the dqkg stage, unrouted, is left to fla's."""
    from moontrain.model.kda.fla_backend import route_fla_stages

    inputs = kda_intra.random_stage_inputs(1, 64, 2, 32, torch.float32, "cpu", seed=0)
    route_fla_stages(dqkg="fla", intra="fla_k64")
    for change in ({}, dict(safe_gate=False), dict(g=torch.cat([inputs["g"]] * 2, dim=2))):
        assert backend().verify("chunk_kda_bwd_intra", **dict(inputs, **change)) == (True, None)
    accepted, why = backend().verify("chunk_kda_bwd_wy_dqkg_fused", **kda_dqkg.random_stage_inputs(
        1, 64, 2, 32, 32, torch.float32, "cpu", seed=0))
    assert not accepted and why == "kernels.kda_dqkg=fla"


def test_runs_moontrain_dqkg_answers_as_the_dispatch_would(backend) -> None:
    """moontrain.model.kda.chunk calls moontrain's dqkg kernel directly (dq, dk in q's dtype) only where fla's
    dispatch would have run it: routed there, on a call its verifier takes; elsewhere fla's own kernel runs."""
    from moontrain.model.kda.fla_backend import route_fla_stages, runs_moontrain_dqkg

    inputs = kda_dqkg.random_stage_inputs(1, 64, 2, 32, 32, torch.float32, "cpu", seed=0)
    route_fla_stages(dqkg="fla", intra="fla")
    assert not runs_moontrain_dqkg(**inputs)
    route_fla_stages(dqkg="moontrain", intra="fla")
    assert runs_moontrain_dqkg(**inputs)
    assert not runs_moontrain_dqkg(**dict(inputs, v=torch.cat([inputs["v"]] * 2, dim=2)))  # grouped value heads
