"""The datasets pipeline: every format gives the same packed stream, ranks partition each epoch's documents,
a restored position yields exactly the batch that would have come (map-style and streaming, across an
epoch boundary), a position saved at another world size skips no document, and bad configs are named.

The reference for a rank's stream is the documents themselves: the packed rows are unpacked (rows overlap
by one token, EOS separates documents) and decoded back to texts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

datasets = pytest.importorskip("datasets")  # absent on the GPU machines

from moontrain.data.config import DataConfig  # noqa: E402
from moontrain.data.mixture import FileTokens  # noqa: E402
from moontrain.data.tiny_corpus import documents, write_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
NUM_DOCS = 23
T, G = 16, 4


def _texts() -> list[str]:
    return [f"document {i:02d} " + "ab" * (i % 5) for i in range(NUM_DOCS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    texts = _texts()
    paths = {"jsonl": root / "docs.jsonl", "text": root / "docs.txt", "parquet": root / "docs.parquet",
             "saved": root / "saved"}
    paths["jsonl"].write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    paths["text"].write_text("".join(t + "\n" for t in texts))
    ds = datasets.Dataset.from_dict({"text": texts})
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["saved"]))
    return paths


def _source(path: Path, rank: int = 0, world: int = 1, **kw) -> FileTokens:
    if path.suffix == ".txt":
        kw.setdefault("text_unit", "line")
    cfg = DataConfig(source="dataset", path=str(path), **kw)
    return FileTokens(cfg, vocab_size=260, seq_len=T, global_batch=G * world, rank=rank, world_size=world)


def _stream(src: FileTokens, batches: int) -> list[int]:
    """The token stream a rank trained on, rebuilt from its batches (consecutive rows share one token)."""
    out: list[int] = []
    for step in range(batches):
        tokens, targets = src.batch(step)
        assert torch.equal(tokens[:, 1:], targets[:, :-1])
        for row_t, row_y in zip(tokens.tolist(), targets.tolist(), strict=True):
            if not out:
                out.append(row_t[0])
            assert out[-1] == row_t[0]
            out.extend(row_y)
    return out


def _docs(stream: list[int]) -> list[str]:
    """Complete documents of a stream (the text after the last EOS is unfinished)."""
    parts, cur = [], []
    for tok in stream:
        if tok == 256:
            parts.append(bytes(cur).decode())
            cur = []
        else:
            cur.append(tok)
    return parts


@pytest.mark.parametrize("fmt", ["text", "parquet", "saved"])
def test_formats_give_the_same_stream(corpus: dict[str, Path], fmt: str) -> None:
    want = _stream(_source(corpus["jsonl"], shuffle=False), 6)
    assert _docs(want)[:5] == _texts()[:5]
    assert _stream(_source(corpus[fmt], shuffle=False), 6) == want
    assert _stream(_source(corpus[fmt], shuffle=False, streaming=True), 6) == want


@pytest.mark.parametrize("streaming", [False, True])
def test_ranks_partition_every_epoch(corpus: dict[str, Path], streaming: bool) -> None:
    world = 3
    per_rank = [_docs(_stream(_source(corpus["jsonl"], r, world, shuffle=not streaming, streaming=streaming), 12))
                for r in range(world)]
    shares = [(NUM_DOCS - r + world - 1) // world for r in range(world)]  # documents g = r mod world
    for epoch in (0, 1):
        seen = []
        for docs, n in zip(per_rank, shares, strict=True):
            assert len(docs) >= 2 * n, "the test must read two epochs"
            seen += docs[epoch * n:(epoch + 1) * n]
        assert sorted(seen) == sorted(_texts()), f"epoch {epoch}: every document exactly once over the ranks"
    in_file_order = [_texts()[g] for g in range(0, NUM_DOCS, world)]
    assert (per_rank[0][:shares[0]] == in_file_order) == streaming, "streaming keeps file order; else shuffled"
    if not streaming:
        assert per_rank[0][:shares[0]] != per_rank[0][shares[0]:2 * shares[0]], "a new order every epoch"


@pytest.mark.parametrize("streaming", [False, True])
def test_restored_position_gives_the_next_batch(corpus: dict[str, Path], streaming: bool) -> None:
    kw = dict(shuffle=not streaming, streaming=streaming)
    world = 2
    for batches_before in (1, 7):  # 7: past the end of the first epoch
        ranks = [_source(corpus["jsonl"], r, world, **kw) for r in range(world)]
        for src in ranks:
            for step in range(batches_before):
                src.batch(step)
        saved = json.loads(json.dumps([src.state_dict() for src in ranks]))  # as stored in a checkpoint
        expected = [[src.batch(batches_before + i) for i in range(3)] for src in ranks]
        for r in range(world):
            resumed = _source(corpus["jsonl"], r, world, **kw)
            resumed.load_state_dict(saved)
            for i in range(3):
                got = resumed.batch(batches_before + i)
                assert torch.equal(got[0], expected[r][i][0]) and torch.equal(got[1], expected[r][i][1]), (r, i)
    assert min(s["sources"]["data"]["epoch"] for s in saved) >= 1, "the second round must start past an epoch boundary"


def test_other_world_size_skips_no_document(corpus: dict[str, Path]) -> None:
    ranks = [_source(corpus["jsonl"], r, 2, shuffle=False) for r in range(2)]
    read = [_docs(_stream(src, 2)) for src in ranks]
    saved = [src.state_dict() for src in ranks]
    single = _source(corpus["jsonl"], 0, 1, shuffle=False)
    single.load_state_dict(saved)
    resumed = _docs(_stream(single, 4))
    fully_read = {d for docs in read for d in docs}
    first_unread = min(i for i, t in enumerate(_texts()) if t not in fully_read)
    start = _texts().index(resumed[0])  # the resumed stream starts at a document boundary
    assert start <= first_unread, "a document not yet read would be skipped"
    assert resumed == (_texts() * 2)[start:start + len(resumed)]  # in order, into the next epoch


def test_bad_configs_are_named(tmp_path: Path, corpus: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=re.escape("data.source=dataset needs data.path")):
        DataConfig(source="dataset")
    with pytest.raises(ValueError, match=re.escape("set data.shuffle=false")):
        DataConfig(source="dataset", path="x.jsonl", streaming=True)
    with pytest.raises(ValueError, match=re.escape("names no file")):
        _source(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=re.escape("text_field='body' is not a column")):
        _source(corpus["jsonl"], text_field="body")
    with pytest.raises(ValueError, match=re.escape("set model.vocab_size >= 257")):
        FileTokens(DataConfig(source="dataset", path=str(corpus["jsonl"])), vocab_size=256, seq_len=T,
                   global_batch=G, rank=0, world_size=1)


def test_shipped_tiny_corpus_is_the_generated_one(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c.jsonl")
    shipped = REPO / "recipes" / "data" / "tiny_corpus.jsonl"
    assert (tmp_path / "c.jsonl").read_bytes() == shipped.read_bytes()
    assert len(documents()) == len(shipped.read_text().splitlines())
    write_corpus(tmp_path / "h.jsonl", num_docs=200, seed=1)
    assert (tmp_path / "h.jsonl").read_bytes() == (REPO / "recipes" / "data" / "tiny_heldout.jsonl").read_bytes()
