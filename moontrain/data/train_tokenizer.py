"""Train a small byte-level BPE tokenizer on a jsonl corpus (offline; used by the tests and the tiny recipe).

The shipped recipes/data/tiny_tokenizer.json is exactly `train_tokenizer(tiny_corpus.jsonl)` (a test checks
it; the BPE trainer is deterministic). Byte-level: every byte is in the vocabulary, so any text encodes.
`<|endoftext|>` (id 0) ends each document. Regenerate with

    python -m moontrain.data.train_tokenizer recipes/data/tiny_corpus.jsonl recipes/data/tiny_tokenizer.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(corpus: str | Path, out: str | Path, *, vocab_size: int = 384, text_field: str = "text") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [json.loads(line)[text_field] for line in Path(corpus).read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(tok.to_str(pretty=False) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m moontrain.data.train_tokenizer CORPUS.jsonl OUT/tokenizer.json")
    print(train_tokenizer(sys.argv[1], sys.argv[2]))
