"""Tokenizers and the other file sources: a trained Hugging Face tokenizer (the shipped one is the script's
output), its documents packed exactly; pre-tokenized `input_ids` columns and flat token files read without
a tokenizer; text files per file or per line; weighted mixtures drawn per row, deterministic, with exact
resume at the same world size and no skipped document at another; the prefetching loader gives the same
batches and positions as the source itself.

References: the documents themselves (tokenized with the `tokenizers` library directly) and the raw token
files; the packed rows are unpacked back into a stream (consecutive rows share one token).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")  # absent on the GPU machines
tokenizers = pytest.importorskip("tokenizers")

from moontrain.data.config import DataConfig, SourceConfig  # noqa: E402
from moontrain.data.loader import BatchLoader  # noqa: E402
from moontrain.data.mixture import FileTokens  # noqa: E402
from moontrain.data.tokenizer import load_tokenizer  # noqa: E402
from moontrain.data.train_tokenizer import EOS_TOKEN, train_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "recipes" / "data" / "tiny_tokenizer.json"
NUM_DOCS = 19
T, G = 16, 4


def _texts(prefix: str = "document") -> list[str]:
    return [f"{prefix} {i:02d} the cat sees " + "a green apple " * (i % 4) for i in range(NUM_DOCS)]


def _ids(texts: list[str]) -> list[list[int]]:
    tok = tokenizers.Tokenizer.from_file(str(SHIPPED))
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    texts, ids = _texts(), _ids(_texts())
    out = {"text_jsonl": root / "text.jsonl", "ids_jsonl": root / "ids.jsonl", "ids_parquet": root / "ids.parquet",
           "ids_saved": root / "ids_saved", "code": root / "code.jsonl", "txt_dir": root / "txt"}
    out["text_jsonl"].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out["ids_jsonl"].write_text("".join(json.dumps({"input_ids": i}) + "\n" for i in ids))
    ds = datasets.Dataset.from_dict({"input_ids": ids})
    ds.to_parquet(str(out["ids_parquet"]))
    ds.save_to_disk(str(out["ids_saved"]))
    out["code"].write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts("def f")))
    out["txt_dir"].mkdir()
    for i, t in enumerate(texts[:5]):
        (out["txt_dir"] / f"{i}.txt").write_text(t + "\nsecond line\n")
    return out


def _source(rank: int = 0, world: int = 1, *, vocab: int = 384, **kw) -> FileTokens:
    kw.setdefault("tokenizer", str(SHIPPED))
    return FileTokens(DataConfig(source="dataset", **kw), vocab_size=vocab, seq_len=T, global_batch=G * world,
                      rank=rank, world_size=world)


def _stream(src, batches: int, start: int = 0) -> list[int]:
    out: list[int] = []
    for step in range(start, start + batches):
        tokens, targets = src.batch(step)
        assert torch.equal(tokens[:, 1:], targets[:, :-1])
        for row_t, row_y in zip(tokens.tolist(), targets.tolist(), strict=True):
            if not out:
                out.append(row_t[0])
            assert out[-1] == row_t[0]
            out.extend(row_y)
    return out


def _split(stream: list[int], eos: int) -> list[list[int]]:
    """Complete documents of a stream (what follows the last EOS is unfinished)."""
    parts, cur = [], []
    for tok in stream:
        if tok == eos:
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    return parts


def test_shipped_tokenizer_is_the_trained_one(tmp_path: Path) -> None:
    out = train_tokenizer(REPO / "recipes" / "data" / "tiny_corpus.jsonl", tmp_path / "tokenizer.json")
    assert out.read_bytes() == SHIPPED.read_bytes()
    tok = load_tokenizer(str(SHIPPED))
    assert tok.vocab_size == 384 and tok.eos_id == tokenizers.Tokenizer.from_file(str(SHIPPED)).token_to_id(EOS_TOKEN)
    text = "The old man finds a wooden box by the sea."
    assert tok.decode(tok.encode_batch([text])[0]) == text
    assert len(tok.encode_batch([text])[0]) < len(text.encode()) / 2  # merges learnt: far fewer ids than bytes


def test_tokenizer_directory_and_eos(tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(SHIPPED.read_bytes())
    assert load_tokenizer(str(d)).eos_id == load_tokenizer(str(SHIPPED)).eos_id
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))  # a plain token as EOS
    assert load_tokenizer(str(d)).eos_id == tokenizers.Tokenizer.from_file(str(SHIPPED)).token_to_id("a")
    assert load_tokenizer(str(SHIPPED), eos_id=7).eos_id == 7
    with pytest.raises(ValueError, match=re.escape("is neither 'bytes' nor an existing tokenizer.json")):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_tokenized_documents_round_trip(files: dict[str, Path]) -> None:
    src = _source(path=str(files["text_jsonl"]), shuffle=False)
    eos = src.tokenizer.eos_id
    docs = _split(_stream(src, 12), eos)
    want = _ids(_texts())
    assert len(docs) >= NUM_DOCS, "the test must read a whole epoch"
    assert docs == (want * 3)[:len(docs)], "the documents in file order, epoch after epoch"


@pytest.mark.parametrize("kind", ["ids_jsonl", "ids_parquet", "ids_saved"])
def test_pretokenized_column_is_the_tokenized_text(files: dict[str, Path], kind: str) -> None:
    want = _stream(_source(path=str(files["text_jsonl"])), 6)
    assert _stream(_source(path=str(files[kind])), 6) == want
    # no tokenizer runs: the byte tokenizer (the default) reads the same ids; only the EOS differs
    eos = load_tokenizer(str(SHIPPED)).eos_id
    got = _stream(_source(path=str(files[kind]), tokenizer="bytes", eos_id=None, vocab=400, shuffle=False), 6)
    assert _split(got, 256)[:3] == _split(_stream(_source(path=str(files["text_jsonl"]), shuffle=False), 6), eos)[:3]
    with pytest.raises(ValueError, match=re.escape("outside model.vocab_size=260")):
        _source(path=str(files[kind]), vocab=260, tokenizer="bytes").batch(0)


def test_vocab_too_small_names_both(files: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=re.escape("has 384 ids but model.vocab_size=300; set model.vocab_size >= "
                                                   "384")):
        _source(path=str(files["text_jsonl"]), vocab=300)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "npy"])
def test_flat_token_file(tmp_path: Path, dtype: str) -> None:
    tokens = np.random.default_rng(0).integers(0, 384, size=10 * T + 5)
    if dtype == "npy":
        path = tmp_path / "tokens.npy"
        np.save(path, tokens.astype(np.uint16))
        kw = {}
    else:
        path = tmp_path / "tokens.bin"
        tokens.astype(dtype).tofile(path)
        kw = {"token_dtype": dtype}
    stream = _stream(_source(path=str(path), shuffle=False, **kw), 2)
    assert stream == tokens[:2 * G * T + 1].tolist(), "one rank, file order: the file's own stream, no EOS added"
    world = 2  # blocks of T tokens alternate between the ranks
    for r in range(world):
        got = _stream(_source(r, world, path=str(path), shuffle=False, **kw), 1)
        blocks = [tokens[g * T:(g + 1) * T].tolist() for g in range(r, 11, world)]
        assert got == [t for block in blocks for t in block][:G * T + 1], r


def test_text_files_per_file_or_line(files: dict[str, Path]) -> None:
    texts = _texts()[:5]
    eos = load_tokenizer(str(SHIPPED)).eos_id
    per_file = _split(_stream(_source(path=str(files["txt_dir"]), shuffle=False), 6), eos)
    assert per_file[:5] == _ids([t + "\nsecond line\n" for t in texts])
    per_line = _split(_stream(_source(path=str(files["txt_dir"]), shuffle=False, text_unit="line"), 6), eos)
    assert per_line[:4] == _ids([texts[0], "second line", texts[1], "second line"])


def _mixture(files: dict[str, Path], rank: int = 0, world: int = 1, **kw) -> FileTokens:
    sources = {"web": SourceConfig(path=str(files["text_jsonl"]), weight=0.7),
               "code": SourceConfig(path=str(files["code"]), weight=0.3)}
    return _source(rank, world, sources=sources, **kw)


def test_mixture_draws_rows_by_weight(files: dict[str, Path]) -> None:
    src = _mixture(files, 0, 1)
    steps = 200
    counts = np.zeros(2)
    for step in range(steps):
        assert np.array_equal(src.choice(step), _mixture(files, 0, 1).choice(step)), "a pure function of (seed, step)"
        counts += np.bincount(src.choice(step), minlength=2)
    share = counts[0] / counts.sum()
    sigma = (0.7 * 0.3 / counts.sum()) ** 0.5
    assert abs(share - 0.7) < 4 * sigma, share
    other_seed = _mixture(files, 0, 1, seed=99)
    assert any(not np.array_equal(src.choice(s), other_seed.choice(s)) for s in range(5))
    # each row holds the stream of the source drawn for it, and the counters say so
    code_ids = set(_ids(["def f"])[0])
    tokens, _ = src.batch(0)
    for row, s in zip(tokens.tolist(), src.choice(0).tolist(), strict=True):
        assert (code_ids <= set(row)) == (s == 1) or len(row) < 8
    assert src.metrics() == {"data/tokens/web": float((src.choice(0) == 0).sum() * T),
                             "data/tokens/code": float((src.choice(0) == 1).sum() * T)}


@pytest.mark.parametrize("kind", ["mixture", "ids_parquet", "flat"])
def test_exact_resume_same_world(files: dict[str, Path], tmp_path: Path, kind: str) -> None:
    world = 2

    def make(r: int) -> FileTokens:
        if kind == "mixture":
            return _mixture(files, r, world)
        if kind == "flat":
            path = tmp_path / "flat.bin"
            np.random.default_rng(1).integers(0, 384, size=9 * T).astype(np.uint16).tofile(path)
            return _source(r, world, path=str(path))
        return _source(r, world, path=str(files[kind]))

    for before in (1, 12):  # 12: past the end of an epoch of every source
        ranks = [make(r) for r in range(world)]
        for src in ranks:
            for step in range(before):
                src.batch(step)
        saved = json.loads(json.dumps([src.state_dict() for src in ranks]))  # as stored in a checkpoint
        expected = [[src.batch(before + i) for i in range(3)] for src in ranks]
        for r in range(world):
            resumed = make(r)
            resumed.load_state_dict(saved)
            for i in range(3):
                got = resumed.batch(before + i)
                assert torch.equal(got[0], expected[r][i][0]) and torch.equal(got[1], expected[r][i][1]), (r, i)
            assert resumed.metrics() == ranks[r].metrics()
    assert min(s["sources"][n]["epoch"] for s in saved for n in s["sources"]) >= 1


@pytest.mark.parametrize("kind", ["mixture", "ids_parquet"])
def test_resume_at_another_world_size_skips_no_document(files: dict[str, Path], kind: str) -> None:
    def make(r: int, world: int) -> FileTokens:
        if kind == "mixture":
            return _mixture(files, r, world, shuffle=False)
        return _source(r, world, path=str(files[kind]), shuffle=False)

    ranks = [make(r, 2) for r in range(2)]
    eos = ranks[0].tokenizer.eos_id
    for src in ranks:
        for step in range(2):
            src.batch(step)
    saved = [src.state_dict() for src in ranks]
    single = make(0, 1)
    single.load_state_dict(saved)
    assert single.metrics() == ranks[0].metrics()
    for name, stream in zip(single.names, single.streams, strict=True):
        docs = _ids(_texts("def f") if name == "code" else _texts())
        states = [s["sources"][name] for s in saved]
        assert all(st["epoch"] == 0 for st in states), "the test reads less than an epoch"
        # a rank finished the documents of its share before its first pending one (file order: shuffle off)
        done = set()
        for st in states:
            first = st["pending"][0][1] if st["pending"] else st["next_doc"]
            done |= set(range(st["rank"], first, st["world_size"]))
        first_unread = min(set(range(NUM_DOCS)) - done)
        rows = stream.rows(8)
        flat = np.concatenate([rows[0], rows[1:, 1:].reshape(-1)]).tolist()  # rows share one token
        resumed = _split(flat, eos)
        start = docs.index(resumed[0])  # the resumed stream starts at a document boundary
        assert start <= first_unread, f"{name}: a document not yet read would be skipped"
        assert resumed == (docs * 2)[start:start + len(resumed)], name


def test_loader_matches_the_source(files: dict[str, Path]) -> None:
    ref = _mixture(files, 1, 2)
    want = [ref.batch(s) for s in range(7)]
    states = []
    loader = BatchLoader(_mixture(files, 1, 2), prefetch=3, device=torch.device("cpu"))
    for s in range(4):
        got = loader.batch(s)
        assert torch.equal(got[0], want[s][0]) and torch.equal(got[1], want[s][1]), s
        states.append(json.loads(json.dumps(loader.state_dict())))
    metrics = loader.take_metrics()
    assert metrics["data/wait_ms"] >= 0 and metrics["data/tokens/web"] + metrics["data/tokens/code"] == 4 * 2 * G * T
    loader.close()  # the thread ran ahead; the position is the one after batch 3
    assert loader.state_dict() == states[-1]
    for s in range(4, 7):
        got = loader.batch(s)
        assert torch.equal(got[0], want[s][0]), s
    loader.close()
    fresh = BatchLoader(_mixture(files, 1, 2), prefetch=2, device=torch.device("cpu"))
    fresh.load_state_dict([states[1], states[1]])  # rank 1 of a 2-rank job reads entry 1
    assert torch.equal(fresh.batch(2)[0], want[2][0])
    fresh.close()
    with pytest.raises(ValueError, match=re.escape("outside model.vocab_size")):
        bad = BatchLoader(_source(path=str(files["ids_jsonl"]), vocab=260, tokenizer="bytes"), prefetch=2,
                          device=torch.device("cpu"))
        bad.batch(0)


def test_streaming_decodes_only_the_ranks_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 streams files whose rank-1 documents cannot be decoded (broken JSON lines, dangling text
    files) and reads only the parquet row groups holding its documents; the stream equals map-style's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join((json.dumps({"text": t}) if g % 2 == 0 else "{not json") + "\n"
                              for g, t in enumerate(texts)))
    txt = tmp_path / "txt"
    txt.mkdir()
    for g, t in enumerate(texts):
        if g % 2 == 0:
            (txt / f"{g:02d}.txt").write_text(t)
        else:
            (txt / f"{g:02d}.txt").symlink_to(tmp_path / "missing")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), parquet, row_group_size=3)
    read_groups: list[int] = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, **kw: read_groups.append(i) or read_row_group(self, i, **kw))

    def stream(path: Path, streaming: bool) -> list[int]:
        return _stream(_source(0, 2, path=str(path), shuffle=False, streaming=streaming), 3)

    want = stream(good, False)
    assert stream(broken, True) == want
    per_file = _stream(_source(0, 2, path=str(txt), shuffle=False, streaming=True), 3)
    eos = load_tokenizer(str(SHIPPED)).eos_id
    assert _split(per_file, eos)[:5] == _ids(texts[0:10:2])
    with pytest.raises(json.JSONDecodeError):
        _stream(_source(1, 2, path=str(broken), shuffle=False, streaming=True), 1)  # rank 1's share is broken
    # 2 ranks, row groups of 3 documents: a group holds documents of both ranks, so rank 0 reads them all in
    # order; with 4 ranks and groups of 3, rank 0 (documents 0, 4, 8, 12, 16) skips group 3 (documents 9-11)
    assert stream(parquet, True) == want
    assert read_groups[:4] == [0, 1, 2, 3]
    read_groups.clear()
    src = FileTokens(DataConfig(source="dataset", path=str(parquet), tokenizer=str(SHIPPED), shuffle=False,
                                streaming=True), vocab_size=384, seq_len=T, global_batch=G * 4, rank=0, world_size=4)
    src.batch(0)
    assert 3 not in read_groups and read_groups[:3] == [0, 1, 2], read_groups
