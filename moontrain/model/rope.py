"""Rotary position embedding for the decoupled rope dims of MLA (interleaved-free, half-split form).

Legend: T sequence length, D rotary dims (even).
"""

from __future__ import annotations

import torch


def rope_cos_sin(seq_len: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq_D2 = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    pos_T = torch.arange(seq_len, device=device, dtype=torch.float32)
    ang_TD2 = torch.outer(pos_T, inv_freq_D2)
    ang_TD = torch.cat([ang_TD2, ang_TD2], dim=-1)
    return ang_TD.cos(), ang_TD.sin()


def apply_rope(x: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D]; rotates pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos_TD + rotated.float() * sin_TD).to(x.dtype)
