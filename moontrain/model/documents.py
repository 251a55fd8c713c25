"""Document masking for packed rows: where documents start, and causal attention that stays inside one.

Legend: B batch, N heads, T sequence, d head dim.

A packed row holds several documents, each ended by the tokenizer's EOS. The token after an EOS starts a
new document: attention (here) and the KDA state and short convolutions (moontrain.model.kda) must not
reach back across it. Derived from the input ids alone, so the data pipeline needs no change and resuming
or resharding the data changes nothing.

Attention paths, one per device kind, same math:
- CPU: SDPA with a boolean [B, 1, T, T] mask (causal and same document). The T x T mask is fine at CPU
  sizes.
- CUDA: flex_attention with a block mask built once per forward (shared by every MLA layer), compiled:
  no T x T tensor, fully masked blocks skipped. It takes qk and v at their own head dims.
Rejected: torch's varlen attention (needs the batch flattened and equal qk/v head dims; MLA's are
192/128); an additive -inf float mask on CUDA (a T x T tensor per row and no block skipping).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class DocumentMask:
    start_BT: torch.Tensor  # bool: the first token of a document that is not the row's first
    id_BT: torch.Tensor  # long: the document's index within the row (0 for the row's first)
    block_mask: Any = None  # CUDA: flex_attention's BlockMask (causal and same document)


def document_mask(tokens_BT: torch.Tensor, eos_id: int) -> DocumentMask:
    start_BT = torch.zeros_like(tokens_BT, dtype=torch.bool)
    start_BT[:, 1:] = tokens_BT[:, :-1] == eos_id
    id_BT = start_BT.long().cumsum(1)
    block_mask = flex_block_mask(id_BT) if tokens_BT.is_cuda else None
    return DocumentMask(start_BT=start_BT, id_BT=id_BT, block_mask=block_mask)


def flex_block_mask(id_BT: torch.Tensor) -> Any:
    """flex_attention's BlockMask for causal attention within each document of id_BT's rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                             kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (id_BT[b, q_idx] == id_BT[b, kv_idx])

    B, T = id_BT.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=id_BT.device)


@functools.cache
def compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def causal_attention(q_BNTd: torch.Tensor, k_BNTd: torch.Tensor, v_BNTd: torch.Tensor, *, scale: float,
                     docs: DocumentMask | None) -> torch.Tensor:
    """Causal softmax attention; with `docs`, a query sees only keys of its own document."""
    if docs is None:
        return F.scaled_dot_product_attention(q_BNTd, k_BNTd, v_BNTd, is_causal=True, scale=scale)
    if docs.block_mask is not None:
        return compiled_flex_attention()(q_BNTd, k_BNTd, v_BNTd, block_mask=docs.block_mask, scale=scale)
    T = q_BNTd.shape[2]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=q_BNTd.device).tril()
    mask_B1TT = (docs.id_BT.unsqueeze(2) == docs.id_BT.unsqueeze(1)).unsqueeze(1) & causal_TT
    return F.scaled_dot_product_attention(q_BNTd, k_BNTd, v_BNTd, attn_mask=mask_B1TT, scale=scale)
