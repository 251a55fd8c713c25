"""Expert load balance: maxvio = max_e T_e / mean(T) - 1 per MoE layer (docs/moonep.md §1).

Legend: L MoE layers, E experts.
"""

from __future__ import annotations

import torch


def maxvio_L(tokens_per_expert_LE: torch.Tensor) -> torch.Tensor:
    counts = tokens_per_expert_LE.float()
    return counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9) - 1.0
