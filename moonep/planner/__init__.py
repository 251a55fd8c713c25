"""The online planner (docs/moonep.md §5): `Plan`, the PyTorch specification (`reference`) and the
fused Triton planner Buffers use on CUDA (`fused`, imported only there: it imports triton)."""

from moonep.planner.plan import Plan
from moonep.planner.reference import make_plan

__all__ = ["Plan", "make_plan"]
