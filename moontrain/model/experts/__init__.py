"""Routed experts: weight storage (master / compute / grad) and the interchangeable EP backends."""

from moontrain.model.experts.backend import ExpertsBackend, ExpertsContext, ExpertsRuntime
from moontrain.model.experts.registry import build_experts_runtime
from moontrain.model.experts.weights import ExpertPlacement, ExpertWeights

__all__ = ["ExpertPlacement", "ExpertWeights", "ExpertsBackend", "ExpertsContext", "ExpertsRuntime", "build_experts_runtime"]
