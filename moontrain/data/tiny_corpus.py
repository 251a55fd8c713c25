"""A small generated English-like corpus for the tests and recipes/k3_tiny.yaml (nothing to download).

Sentences come from a fixed little grammar (subject, verb, object, place), so a tiny model can learn
real structure in a minute: the byte-level loss falls from log(257) towards ~1 nat. The shipped file
recipes/data/tiny_corpus.jsonl is exactly `write_corpus(path)` and the held-out set
recipes/data/tiny_heldout.jsonl is `write_corpus(path, num_docs=200, seed=1)` (a test checks both);
regenerate with

    python -m moontrain.data.tiny_corpus recipes/data/tiny_corpus.jsonl
    python -m moontrain.data.tiny_corpus recipes/data/tiny_heldout.jsonl 200 1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

_SUBJECTS = ["the cat", "a small dog", "the old man", "my sister", "the farmer", "a young bird", "the teacher",
             "our neighbour"]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "feeds", "watches"]
_OBJECTS = ["the red ball", "a green apple", "the little boat", "an old book", "the blue kite", "a warm loaf",
            "the silver key", "a wooden box"]
_PLACES = ["in the garden", "near the river", "at the market", "on the hill", "by the sea", "under the tree"]
_TIMES = ["every morning", "at night", "on sunday", "after lunch"]


def documents(num_docs: int = 1000, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(int(rng.integers(1, 5))):
            words = [_SUBJECTS[rng.integers(len(_SUBJECTS))], _VERBS[rng.integers(len(_VERBS))],
                     _OBJECTS[rng.integers(len(_OBJECTS))], _PLACES[rng.integers(len(_PLACES))]]
            if rng.random() < 0.5:
                words.append(_TIMES[rng.integers(len(_TIMES))])
            sentence = " ".join(words)
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        docs.append(" ".join(sentences))
    return docs


def write_corpus(path: str | Path, num_docs: int = 1000, seed: int = 0) -> None:
    lines = [json.dumps({"id": i, "text": text}) for i, text in enumerate(documents(num_docs, seed))]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 4):
        raise SystemExit("usage: python -m moontrain.data.tiny_corpus OUT.jsonl [NUM_DOCS SEED]")
    write_corpus(sys.argv[1], *(int(a) for a in sys.argv[2:]))
