"""The built-in offline tokenizer: UTF-8 bytes (ids 0..255) and one end-of-document id (256).

No vocabulary file and nothing to download; any text round-trips exactly. Documents are packed back to
back with EOS between them, so the model sees where one ends.
"""

from __future__ import annotations


class ByteTokenizer:
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
