"""The decoding cache: one state per layer, appended to as tokens are decoded.

Legend: B batch, S cached positions (capacity), T new tokens, C kv latent width (kv_lora_rank), Dr rope dims.

An MLA layer caches what its keys and values are made from, not the keys and values: the normed kv
latent c [B, S, C] and the rotated shared rope key [B, S, Dr] (C + Dr numbers per token and layer,
against N * (Dn + Dr + Dv) for plain multi-head attention). A layer of another kind (a linear-attention
layer's recurrent state, for one) adds its own state class with the same two calls: `append` the new
tokens' state and return what attention at these positions reads. A KDA layer (KDACache) keeps its
recurrent state [B, H, K, V] (fp32) and the last W - 1 inputs of each short convolution: a fixed size,
whatever the length.
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
    def __init__(self, batch: int, heads: int, head_dim: int, conv_size: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.state_BHKV = torch.zeros(batch, heads, head_dim, head_dim, dtype=torch.float32, device=device)
        # per q/k/v: the last W - 1 projections before the convolution (zeros: the start of the sequence)
        self.tails_BWC = [torch.zeros(batch, conv_size - 1, heads * head_dim, dtype=dtype, device=device)
                          for _ in range(3)]

    def extend(self, which: int, x_BTC: torch.Tensor) -> torch.Tensor:
        """The cached tail followed by the new projections (the convolution's input); keeps the new tail."""
        full = torch.cat([self.tails_BWC[which], x_BTC], dim=1)
        self.tails_BWC[which] = full[:, full.shape[1] - self.tails_BWC[which].shape[1]:]
        return full


class DecodeCache:
    """Per-layer states of one batch of sequences; `start` is the position of the next token."""

    def __init__(self, layers: list[MLACache | KDACache]) -> None:
        self.layers = layers
        self.start = 0
        self.tokens_BS: torch.Tensor | None = None  # every token so far: the documents (model.document_eos_id)
