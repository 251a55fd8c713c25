"""flex_block_mask: the document-causal BlockMask read from the documents' block bounds, bitwise the one
torch's create_block_mask builds by evaluating the mask at every position (every tensor the BlockMask holds:
the partial and full blocks by query row and their transposes by key column, in create_block_mask's order).

Cases: documents starting on a block's first or last token, a row of one document (every earlier block
full), a row of one-token documents, T below, at and between multiples of flex's 128-token block, and a
block size of 16 so that small T spans many blocks.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from moontrain.model.documents import FLEX_BLOCK, document_ids, flex_block_mask

EOS = 1
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _reference(id_BT: torch.Tensor, block: int):
    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (id_BT[b, q_idx] == id_BT[b, kv_idx])

    B, T = id_BT.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=id_BT.device, BLOCK_SIZE=block)


def _assert_same(id_BT: torch.Tensor, block: int = FLEX_BLOCK) -> None:
    want, got = _reference(id_BT, block), flex_block_mask(id_BT, block)
    for name in FIELDS:
        w, g = getattr(want, name), getattr(got, name)
        assert w.dtype == g.dtype and w.shape == g.shape and torch.equal(w, g), f"{name}: {g} != {w}"
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE


def _ids(tokens_BT: torch.Tensor) -> torch.Tensor:
    return document_ids(tokens_BT, EOS)[1]


@pytest.mark.parametrize(("B", "T", "eos_rate", "block"), [
    (2, 300, 0.01, 128), (3, 1024, 0.003, 128), (1, 1, 0.5, 128), (2, 128, 0.0, 128), (2, 257, 0.02, 128),
    (1, 1000, 0.3, 128), (2, 640, 0.0, 128), (3, 200, 0.05, 16), (2, 97, 1.0, 16), (4, 2048, 0.002, 128)])
def test_random_documents_match_create_block_mask(B: int, T: int, eos_rate: float, block: int) -> None:
    gen = torch.Generator().manual_seed(B * 1000 + T)
    tokens = torch.where(torch.rand(B, T, generator=gen) < eos_rate, EOS, 2)
    _assert_same(_ids(tokens), block)


@pytest.mark.parametrize("eos_at", [[126], [127], [128], [255, 256], [0, 383], [127, 255, 383]])
def test_documents_starting_at_block_edges(eos_at: list[int]) -> None:
    """An EOS at position p starts a document at p + 1: on a block's last token (p = 126), first token
    (p = 127) or second (p = 128)."""
    tokens = torch.full((2, 512), 2)
    tokens[0, eos_at] = EOS
    tokens[1, [p + 1 for p in eos_at]] = EOS
    _assert_same(_ids(tokens))


def test_one_document_makes_every_earlier_block_full() -> None:
    mask = flex_block_mask(torch.zeros(1, 4 * FLEX_BLOCK, dtype=torch.long))
    assert mask.full_kv_num_blocks.flatten().tolist() == [0, 1, 2, 3]
    assert mask.kv_num_blocks.flatten().tolist() == [1, 1, 1, 1]  # the diagonal's causal blocks
