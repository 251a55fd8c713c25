"""The experts-backend registry: builds one model's ExpertsRuntime by name.

It imports the backends; they import only the interface (backend.py), never this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moontrain.model.experts.alltoall import AllToAllExperts
from moontrain.model.experts.backend import ExpertsBackend, ExpertsContext, ExpertsRuntime
from moontrain.model.experts.local import LocalExperts
from moontrain.model.experts.moonep_backend import MoonEPRuntime
from moontrain.model.experts.weights import ExpertWeights


@dataclass
class PerLayerRuntime:
    """The runtime of backends that share nothing: each layer's backend stands alone."""

    ctx: ExpertsContext
    build: Callable[[ExpertsContext, ExpertWeights], ExpertsBackend]

    def layer(self, weights: ExpertWeights) -> ExpertsBackend:
        return self.build(self.ctx, weights)

    def finish_backward(self) -> None:
        pass

    def close(self) -> None:
        pass


RUNTIMES: dict[str, Callable[[ExpertsContext], ExpertsRuntime]] = {
    "local": lambda ctx: PerLayerRuntime(ctx, LocalExperts),
    "alltoall": lambda ctx: PerLayerRuntime(ctx, AllToAllExperts),
    "moonep": MoonEPRuntime,
}


def build_experts_runtime(name: str, ctx: ExpertsContext) -> ExpertsRuntime:
    if name not in RUNTIMES:
        raise ValueError(f"unknown experts backend {name!r}; choose one of {sorted(RUNTIMES)}")
    return RUNTIMES[name](ctx)
