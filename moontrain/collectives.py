"""The single-tensor collectives under the names of the installed torch.

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single (the old names warn); torch 2.11, inside the supported range, has only the old
ones. Both take (output, input) with the input (all-gather: output) the concatenation of the group's
per-rank tensors along dim 0.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
