"""moonep: perfectly balanced expert parallelism (MoonEP-style) for PyTorch.

Every EP rank receives exactly s*K token slots per call, whatever the routing, by planning a few
redundant experts online. docs/moonep.md is the design record; `Buffer` is the communication object,
`ExpertPools` owns expert weights in symmetric memory, `expert_glu` is the autograd op (its gated
activation a parameter: moonep.activation; `situ_glu` is K3's as a differentiable op of its own,
`glu_backward` an activation's one-pass backward),
`BufferOptions` how a buffer runs, `Layout` the sizes of its symmetric memory (usable without a process
group, e.g. to size a job); `HierarchicalBuffer` and `hierarchical_expert_glu` run one EP group over
several hosts (moonep.hierarchical). moontrain uses only these names.
"""

from moonep.activation import ACTIVATIONS, glu_backward, situ_glu
from moonep.buffer import Buffer, DispatchResult
from moonep.comm_stream import CommEvent
from moonep.config import BufferConfig, BufferOptions
from moonep.errors import MoonEPTimeoutError
from moonep.hierarchical import HierarchicalBuffer, hierarchical_expert_glu, host_groups
from moonep.layout import Layout, receive_rows, remote_experts
from moonep.moe import expert_glu, glu_projections, merge_gate_up, split_gate_up
from moonep.planner import Plan, make_plan
from moonep.pools import ExpertPools, LayerExperts

__all__ = [
    "ACTIVATIONS",
    "Buffer",
    "BufferConfig",
    "BufferOptions",
    "CommEvent",
    "DispatchResult",
    "ExpertPools",
    "HierarchicalBuffer",
    "LayerExperts",
    "Layout",
    "MoonEPTimeoutError",
    "Plan",
    "expert_glu",
    "glu_backward",
    "glu_projections",
    "hierarchical_expert_glu",
    "host_groups",
    "make_plan",
    "merge_gate_up",
    "receive_rows",
    "remote_experts",
    "situ_glu",
    "split_gate_up",
]
