"""moonep: perfectly balanced expert parallelism (MoonEP-style) for PyTorch.

Every EP rank receives exactly s*K token slots per call, whatever the routing, by planning a few
redundant experts online. See SPEC.md for the contract; `Buffer` is the communication object,
`ExpertPools` owns expert weights in symmetric memory, `expert_swiglu` is the autograd op.
"""

from moonep.buffer import Buffer, DispatchResult
from moonep.comm_stream import CommEvent
from moonep.config import BufferConfig
from moonep.errors import MoonEPTimeoutError
from moonep.moe import expert_swiglu, swiglu_projections
from moonep.planner import Plan, make_plan
from moonep.pools import ExpertPools, LayerExperts

__all__ = [
    "Buffer",
    "BufferConfig",
    "CommEvent",
    "DispatchResult",
    "ExpertPools",
    "LayerExperts",
    "MoonEPTimeoutError",
    "Plan",
    "expert_swiglu",
    "make_plan",
    "swiglu_projections",
]
