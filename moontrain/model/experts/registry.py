"""The experts-backend registry: builds one backend per MoE layer by name.

It imports the backends; they import only the interface (backend.py), never this module.
"""

from __future__ import annotations

from collections.abc import Callable

from moontrain.model.experts.alltoall import AllToAllExperts
from moontrain.model.experts.backend import ExpertsBackend, ExpertsContext
from moontrain.model.experts.local import LocalExperts
from moontrain.model.experts.moonep_backend import MoonEPExperts
from moontrain.model.experts.weights import ExpertWeights

BACKENDS: dict[str, Callable[[ExpertsContext, ExpertWeights], ExpertsBackend]] = {
    "local": LocalExperts,
    "alltoall": AllToAllExperts,
    "moonep": MoonEPExperts,
}


def build_experts_backend(name: str, ctx: ExpertsContext, weights: ExpertWeights) -> ExpertsBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown experts backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name](ctx, weights)
