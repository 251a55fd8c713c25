"""Document masking for packed rows: where documents start, and causal attention that stays inside one.

Legend: B batch, N heads, T sequence, d head dim.

A packed row holds several documents, each ended by the tokenizer's EOS. The token after an EOS starts a
new document: attention (here) and the KDA state and short convolutions (moontrain.model.kda) must not
reach back across it. Derived from the input ids alone, so the data pipeline needs no change and resuming
or resharding the data changes nothing; fla's sequence bounds come from the host's copy of the same ids when
the trainer passes it (the loader keeps it), which spares the forward its host syncs.

Attention paths, one per device kind, same math:
- CPU: SDPA with a boolean [B, 1, T, T] mask (causal and same document). The T x T mask is fine at CPU
  sizes.
- CUDA: flex_attention with a block mask built once per forward (shared by every MLA layer) from the
  documents' block bounds (flex_block_mask), compiled: no T x T tensor, fully masked blocks skipped. It
  takes qk and v at their own head dims. Its Triton backward has no atomics (dQ per query block, dK/dV per
  key block), so it is deterministic.
- No documents: SDPA with is_causal (cuDNN or memory-efficient attention on CUDA, whose backward
  accumulates dQ with atomics), or, in deterministic mode (train.deterministic), flex_attention with the
  plain causal block mask of causal_flex_mask: a DocumentMask without document ids, which the KDA layers
  and QK-Clip read as "one document per row".
Rejected: torch's varlen attention (needs the batch flattened and equal qk/v head dims; MLA's are
192/128); an additive -inf float mask on CUDA (a T x T tensor per row and no block skipping).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # flex_attention's default block of queries and keys


@dataclass(frozen=True, slots=True)
class DocumentMask:
    # None for both: one document per row (causal_flex_mask)
    start_BT: torch.Tensor | None  # bool: the first token of a document that is not the row's first
    id_BT: torch.Tensor | None  # long: the document's index within the row (0 for the row's first)
    block_mask: Any = None  # CUDA: flex_attention's BlockMask (causal and same document)
    # (device, host) cu_seqlens of the batch flattened to one row (flat_sequence_bounds), fla's KDA layout, made
    # once per forward for every KDA layer (from the host's copy of the ids: no host sync; else one); only for a
    # model whose KDA layers run fla
    seq_bounds: tuple[torch.Tensor, torch.Tensor] | None = None


def document_ids(tokens_BT: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start_BT, id_BT) of DocumentMask."""
    start_BT = torch.zeros_like(tokens_BT, dtype=torch.bool)
    start_BT[:, 1:] = tokens_BT[:, :-1] == eos_id
    return start_BT, start_BT.long().cumsum(1)


def document_mask(tokens_BT: torch.Tensor, eos_id: int, *, seq_bounds: bool = False,
                  host_tokens_BT: torch.Tensor | None = None) -> DocumentMask:
    """seq_bounds: also fla's sequence bounds (a model whose KDA layers run fla), from host_tokens_BT (the same ids
    on the host: no host sync) when given, else from the device's (one sync)."""
    start_BT, id_BT = document_ids(tokens_BT, eos_id)
    bounds = None
    if seq_bounds:
        if host_tokens_BT is not None and host_tokens_BT.shape != tokens_BT.shape:
            raise ValueError(f"host_tokens_BT {tuple(host_tokens_BT.shape)} must be tokens_BT's shape "
                             f"{tuple(tokens_BT.shape)}: the same ids on the host")
        bounds = (flat_sequence_bounds(start_BT) if host_tokens_BT is None
                  else host_sequence_bounds(document_ids(host_tokens_BT.cpu(), eos_id)[0], tokens_BT.device))
    return DocumentMask(start_BT=start_BT, id_BT=id_BT,
                        block_mask=flex_block_mask(id_BT) if tokens_BT.is_cuda else None, seq_bounds=bounds)


def flat_sequence_bounds(start_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens of the batch flattened to one row, where every row start and every document start opens a
    sequence: [0, ..., B * T] (int64), on start_BT's device and on the host (one host sync)."""
    B, T = start_BT.shape
    starts_BT = start_BT.clone()
    starts_BT[:, 0] = True
    cu_seqlens = F.pad(starts_BT.flatten().nonzero().flatten(), (0, 1), value=B * T)
    return cu_seqlens, cu_seqlens.cpu()


def host_sequence_bounds(host_start_BT: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_sequence_bounds of host document starts without a host sync: computed on the host, copied to
    `device` asynchronously (from pinned memory on CUDA)."""
    _, host = flat_sequence_bounds(host_start_BT)
    if torch.device(device).type != "cuda":
        return host.to(device), host
    return host.pin_memory().to(device, non_blocking=True), host


def flex_block_mask(id_BT: torch.Tensor, block: int = FLEX_BLOCK) -> Any:
    """flex_attention's BlockMask for causal attention within each document of id_BT's rows: the BlockMask that
    create_block_mask(same_document_causal, B, None, T, T) builds (bitwise: test_document_block_mask.py), read
    from the documents' block bounds in a few launches on [B, T / block] tensors, where create_block_mask
    evaluates the mask over every [B, T, T] position (a vmap of the mask function, ~3 ms of host work a
    forward) and counts each block's true entries.

    Document ids never decrease along a row, so for a query block i and an earlier key block j < i: some pair
    shares a document iff j's last id is i's first (every other pair has the key's id below the query's), and
    every pair does iff j's first id is i's last (one document spans both) and block i is whole (padded query
    rows past T are masked). The diagonal block is partial (causal inside it); later key blocks are empty."""
    from torch.nn.attention.flex_attention import BlockMask

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                             kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (id_BT[b, q_idx] == id_BT[b, kv_idx])

    T = id_BT.shape[1]
    nb = -(-T // block)
    first_Bn = id_BT[:, ::block]
    ends = torch.arange(1, nb + 1, device=id_BT.device) * block
    last_Bn = id_BT[:, ends.clamp_max(T) - 1]
    i_n1, j_1n = torch.arange(nb, device=id_BT.device).unsqueeze(1), torch.arange(nb, device=id_BT.device)
    earlier_nn = j_1n < i_n1
    shares_Bnn = (last_Bn.unsqueeze(1) == first_Bn.unsqueeze(2)) & earlier_nn
    whole_n1 = (ends <= T).unsqueeze(1)
    full_Bnn = (first_Bn.unsqueeze(1) == last_Bn.unsqueeze(2)) & earlier_nn & whole_n1
    partial_Bnn = (shares_Bnn & ~full_Bnn) | (i_n1 == j_1n)
    kv_num, kv_idx = _ordered_blocks(partial_Bnn.unsqueeze(1))
    full_num, full_idx = _ordered_blocks(full_Bnn.unsqueeze(1))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=same_document_causal, seq_lengths=(T, T))


def _ordered_blocks(dense_BHnn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks, indices) of a dense [B, H, n, n] block matrix, ordered as create_block_mask
    orders them: each row's marked blocks first, ascending, then the rest, ascending (a stable descending sort)."""
    dense = dense_BHnn.to(torch.int32)
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


@functools.lru_cache(maxsize=8)
def causal_flex_mask(seq_len: int, device: torch.device) -> DocumentMask:
    """One document per row, attended through flex_attention: the plain causal block mask (broadcast over
    batch and heads; cached per length and device, it does not depend on the tokens)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, seq_len, seq_len, device=device)
    return DocumentMask(start_BT=None, id_BT=None, block_mask=block_mask)


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
    assert docs.id_BT is not None, "a DocumentMask without document ids carries a flex block mask"
    T = q_BNTd.shape[2]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=q_BNTd.device).tril()
    mask_B1TT = (docs.id_BT.unsqueeze(2) == docs.id_BT.unsqueeze(1)).unsqueeze(1) & causal_TT
    return F.scaled_dot_product_attention(q_BNTd, k_BNTd, v_BNTd, attn_mask=mask_B1TT, scale=scale)
