"""The decoding cache: one state per layer, appended to as tokens are decoded.

Legend: B batch, S cached positions (capacity), T new tokens, C kv latent width (kv_lora_rank), Dr rope dims.

An MLA layer caches what its keys and values are made from, not the keys and values: the normed kv
latent c [B, S, C] and the rotated shared rope key [B, S, Dr] (C + Dr numbers per token and layer,
against N * (Dn + Dr + Dv) for plain multi-head attention). A KDA (linear attention) layer caches a
fixed-size state instead: the recurrent state S [B, H, K, V] (fp32) and the last W - 1 inputs of each
short convolution, whatever the number of positions decoded.
"""

from __future__ import annotations

import torch


class MLACache:
    def __init__(self, batch: int, capacity: int, latent: int, rope: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.c_BSC = torch.zeros(batch, capacity, latent, dtype=dtype, device=device)
        self.k_rope_BSDr = torch.zeros(batch, capacity, rope, dtype=dtype, device=device)
        self.length = 0

    def append(self, c_BTC: torch.Tensor, k_rope_BTDr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions; returns every cached position's (c, rotated rope key) so far."""
        end = self.length + c_BTC.shape[1]
        if end > self.c_BSC.shape[1]:
            raise ValueError(f"decoding past the cache capacity of {self.c_BSC.shape[1]} positions; build the "
                             "cache with a larger max_len (prompt + new tokens)")
        self.c_BSC[:, self.length:end] = c_BTC
        self.k_rope_BSDr[:, self.length:end] = k_rope_BTDr
        self.length = end
        return self.c_BSC[:, :end], self.k_rope_BSDr[:, :end]


class KDACache:
    def __init__(self, batch: int, heads: int, head_dim: int, conv_taps: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.S_BHKV = torch.zeros(batch, heads, head_dim, head_dim, dtype=torch.float32, device=device)
        # the last W - 1 inputs of the q, k and v convolutions (zeros before the first token: the
        # convolution's own zero padding)
        self.conv = {name: torch.zeros(batch, conv_taps - 1, heads * head_dim, dtype=dtype, device=device)
                     for name in ("q", "k", "v")}

    def extend(self, name: str, x_BTC: torch.Tensor) -> torch.Tensor:
        """The convolution input [B, W - 1 + T, C] ending with the new tokens; the state keeps its tail."""
        x_BUC = torch.cat([self.conv[name], x_BTC], dim=1)
        self.conv[name] = x_BUC[:, x_BUC.shape[1] - self.conv[name].shape[1]:]
        return x_BUC


class DecodeCache:
    """Per-layer states of one batch of sequences; `start` is the position of the next token."""

    def __init__(self, layers: list[MLACache | KDACache]) -> None:
        self.layers = layers
        self.start = 0
