"""Rotary position embedding for the decoupled rope dims of MLA (interleaved-free, half-split form), with
optional YaRN context extension (DeepSeek-V3 / Kimi K2).

Legend: T sequence length, D rotary dims (even).

Checkpoints in the DeepSeek-V3 / Kimi K2 format store the rope rows of the q and kv-a projections with
rotation pairs interleaved, (2i, 2i+1); here a pair is (i, i + D/2). moontrain.checkpoint's HF export
and import permute those rows (the math is otherwise the same).
"""

from __future__ import annotations

import math

import torch

from moontrain.model.config import ModelConfig, YarnConfig


def rope_cos_sin(seq_len: int, dim: int, theta: float, device: torch.device, *, yarn: YarnConfig | None = None,
                 start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] of positions start .. start + seq_len - 1."""
    inv_freq_D2 = rope_inv_freq(dim, theta, yarn).to(device)
    pos_T = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    ang_TD2 = torch.outer(pos_T, inv_freq_D2)
    ang_TD = torch.cat([ang_TD2, ang_TD2], dim=-1)
    if yarn is None:
        return ang_TD.cos(), ang_TD.sin()
    factor = yarn_attention_factor(yarn)
    return ang_TD.cos() * factor, ang_TD.sin() * factor


def rope_inv_freq(dim: int, theta: float, yarn: YarnConfig | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32, CPU); YaRN ramps each from extrapolated to interpolated."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if yarn is None:
        return 1.0 / pos_freqs
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the extrapolated share
    return interpolated * (1 - keep) + extrapolated * keep


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(yarn: YarnConfig) -> float:
    """The scale of cos/sin under YaRN."""
    if yarn.mscale and yarn.mscale_all_dim:
        return _yarn_mscale(yarn.factor, yarn.mscale) / _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return _yarn_mscale(yarn.factor, 1.0)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times m(mscale_all_dim)^2 under YaRN with mscale_all_dim."""
    scale = 1.0 / math.sqrt(cfg.qk_head_dim)
    yarn = cfg.rope_yarn
    if yarn is not None and yarn.mscale_all_dim:
        m = _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rope(x: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D]; rotates pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos_TD + rotated.float() * sin_TD).to(x.dtype)


def interleaved_to_half_split(dim: int) -> torch.Tensor:
    """Row order that turns interleaved rope rows (pairs (2i, 2i+1)) into half-split ones (pairs (i, i + D/2))."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def half_split_to_interleaved(dim: int) -> torch.Tensor:
    """The inverse of interleaved_to_half_split."""
    return torch.argsort(interleaved_to_half_split(dim))
