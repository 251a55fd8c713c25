"""Tokenizers: the built-in byte tokenizer, or a local Hugging Face tokenizer (nothing is downloaded).

`data.tokenizer`:
  - `bytes`: UTF-8 bytes (ids 0..255) and one end-of-document id (256). No file; any text round-trips.
  - a `tokenizer.json` file, or a directory holding one: loaded with the `tokenizers` library.
  - a directory without tokenizer.json (e.g. only a sentencepiece model and tokenizer_config.json):
    transformers' AutoTokenizer with local_files_only=True.

The end-of-document id comes from the tokenizer: a directory's tokenizer_config.json `eos_token`, else the
first of the usual end-of-text tokens the vocabulary has. `data.eos_id` overrides it. Documents are
packed back to back with EOS between them, so the model sees where one ends. The vocabulary (added
tokens included) must fit model.vocab_size; a larger model vocabulary is fine (unused rows).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

# the files of a tokenizer directory (what a run's record digests and an export copies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int  # ids are in [0, vocab_size)

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json) or a transformers tokenizer, without special tokens added
    around each document (the packer adds EOS)."""

    def __init__(self, spec: str, eos_id: int | None) -> None:
        path = Path(spec)
        json_file = path / "tokenizer.json" if path.is_dir() else path
        config = _read_config(path / "tokenizer_config.json") if path.is_dir() else {}
        if json_file.is_file():
            from tokenizers import Tokenizer as RustTokenizer

            try:
                self._tok = RustTokenizer.from_file(str(json_file))
            except Exception as err:  # the Rust library raises its own Exception type
                raise ValueError(f"data.tokenizer={spec!r}: {json_file} is not a tokenizer.json file ({err})") from err
            self._auto = None
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            lookup = self._tok.token_to_id
        elif path.is_dir():
            try:
                from transformers import AutoTokenizer
            except ImportError as err:
                raise ValueError(f"data.tokenizer={spec!r} has no tokenizer.json; loading it needs the transformers "
                                 "package (pip install transformers)") from err
            try:
                self._auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as err:
                raise ValueError(f"data.tokenizer={spec!r}: transformers cannot load this directory ({err})") from err
            self._tok = None
            self.vocab_size = len(self._auto)
            vocab = self._auto.get_vocab()
            lookup = vocab.get
        else:
            raise ValueError(f"data.tokenizer={spec!r} is neither 'bytes' nor an existing tokenizer.json file or "
                             "tokenizer directory")
        self.eos_id = eos_id if eos_id is not None else _find_eos(spec, config, lookup)
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"data.eos_id={self.eos_id} is outside the vocabulary of {spec!r} "
                             f"(size {self.vocab_size})")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tok is not None:  # the Rust library encodes a batch in parallel, outside the GIL
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return self._auto(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=False)
        return self._auto.decode(ids)

    def token(self, idx: int) -> str:
        """The vocabulary entry of id `idx` (e.g. the EOS token's text, for an export's tokenizer_config.json)."""
        if self._tok is not None:
            return self._tok.id_to_token(idx)
        return self._auto.convert_ids_to_tokens(idx)


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def _find_eos(spec: str, config: dict, lookup) -> int:
    token = config.get("eos_token")
    if isinstance(token, dict):  # the AddedToken form: {"content": "</s>", ...}
        token = token.get("content")
    candidates = ([token] if isinstance(token, str) else []) + list(_EOS_CANDIDATES)
    for name in candidates:
        idx = lookup(name)
        if idx is not None:
            return int(idx)
    raise ValueError(f"data.tokenizer={spec!r} has no end-of-document token (looked for {candidates}); set data.eos_id "
                     "to the id the packer puts between documents")


def load_tokenizer(spec: str, *, eos_id: int | None = None) -> ByteTokenizer | HFTokenizer:
    """`bytes` or a local Hugging Face tokenizer (see the module docstring)."""
    if spec == "bytes":
        if eos_id is not None and eos_id != ByteTokenizer.eos_id:
            raise ValueError(f"data.eos_id={eos_id}: the byte tokenizer's end-of-document id is 256; leave data.eos_id "
                             "unset")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_id)


def tokenizer_files(spec: str) -> list[Path]:
    """The files a tokenizer spec names: the file itself, or the tokenizer files of a directory."""
    path = Path(spec)
    return [path] if path.is_file() else [path / f for f in TOKENIZER_FILES if (path / f).is_file()]


def tokenizer_digest(spec: str) -> str:
    """sha256 over a tokenizer's files (names and contents): whether a tokenizer is still the one a run used."""
    h = hashlib.sha256()
    for f in tokenizer_files(spec):
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def tokenizer_record(spec: str, tokenizer: ByteTokenizer | HFTokenizer) -> dict[str, Any]:
    """What a checkpoint remembers of its run's tokenizer: the spec (`bytes`, or the absolute path), the
    vocabulary size, the EOS id and the digest of its files."""
    if spec == "bytes":
        return {"spec": "bytes", "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    return {"spec": str(Path(spec).resolve()), "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
            "sha256": tokenizer_digest(spec)}


def check_vocab(tokenizer_spec: str, tokenizer_vocab: int, model_vocab: int) -> None:
    if tokenizer_vocab > model_vocab:
        raise ValueError(f"data.tokenizer={tokenizer_spec} has {tokenizer_vocab} ids but "
                         f"model.vocab_size={model_vocab}; "
                         f"set model.vocab_size >= {tokenizer_vocab}")
