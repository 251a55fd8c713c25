"""The tokenizer a model was trained with travels with it: recorded in the checkpoint, written into the export
as tokenizer.json + tokenizer_config.json, and used (or a mismatch refused) by generate / eval.

References: the run's own tokenizer (HFTokenizer over the shipped tiny_tokenizer.json) for the ids the
export's tokenizer produces, through moontrain and through transformers' AutoTokenizer; UTF-8 bytes for
the byte tokenizer's export; the held-out loss through the checkpoint for the loss through its fp32
export (the same weights and rows, so the same float64 sum).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moontrain.checkpoint import export_hf
from moontrain.checkpoint.run_tokenizer import byte_tokenizer_json
from moontrain.cli import main
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.data.tokenizer import load_tokenizer
from moontrain.generate.load import load_model
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import train

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
CORPUS = str(ROOT / "recipes/data/tiny_corpus.jsonl")
HELDOUT = str(ROOT / "recipes/data/tiny_heldout.jsonl")
TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, a café in Zürich."


def _checkpoint(tmp_path: Path, tokenizer: str, vocab_size: int) -> Path:
    torch.set_num_threads(1)
    cfg = from_dict(RunConfig, {
        "model": {**load_recipe(ROOT / "recipes/k3_tiny.yaml")["model"], "vocab_size": vocab_size},
        "experts": {"backend": "local"}, "parallel": {"ep": 1},
        "train": {"steps": 2, "global_batch_size": 2, "seq_len": 32, "seed": 2, "run_dir": str(tmp_path / "run"),
                  "log_every": 1},
        "data": {"source": "dataset", "path": CORPUS, "tokenizer": tokenizer}, "metrics": {"wandb": False},
    })
    trainer = Trainer(cfg, single_process_layout(CPU))
    train(trainer, 2)
    return trainer.save_checkpoint()


def test_export_carries_the_run_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bpe = tmp_path / "bpe384.json"  # a tokenizer file not named tokenizer.json
    shutil.copyfile(ROOT / "recipes/data/tiny_tokenizer.json", bpe)
    ckpt = _checkpoint(tmp_path, str(bpe), 384)
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert "tokenizer.json + tokenizer_config.json" in capsys.readouterr().out
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").read_bytes() == bpe.read_bytes()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["bos_token"] == "<|endoftext|>"
    want = load_tokenizer(str(bpe)).encode_batch([TEXT])[0]
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)  # the model's code: see docs/hf.md
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == want and auto.eos_token_id == 0
    _, tok = load_model(out, device=CPU)
    assert tok.encode_batch([TEXT])[0] == want and tok.vocab_size == 384
    # the checkpoint and its fp32 export evaluate the same held-out rows to the same loss
    losses = []
    for model in (ckpt, out):
        assert main(["eval", str(model), "--data", HELDOUT, "--seq-len", "64", "--batches", "2", "--batch-size", "2",
                     "--device", "cpu"]) == 0
        losses.append(capsys.readouterr().out.split()[1])
    assert losses[0] == losses[1], losses


def test_a_tokenizer_that_does_not_match_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bpe = tmp_path / "bpe384.json"
    shutil.copyfile(ROOT / "recipes/data/tiny_tokenizer.json", bpe)
    ckpt = _checkpoint(tmp_path, str(bpe), 384)
    with pytest.raises(ValueError, match=r"--tokenizer bytes has 257 ids, but .* was trained with .*bpe384.json "
                                         r"\(384 ids\)"):
        load_model(ckpt, device=CPU, tokenizer="bytes")
    out = export_hf(ckpt, tmp_path / "hf")
    (out / "tokenizer.json").unlink()
    (out / "tokenizer_config.json").unlink()
    assert main(["generate", str(out), "--prompt", "x", "--device", "cpu"]) == 2
    assert "holds no tokenizer (no tokenizer.json or tokenizer_config.json); pass --tokenizer" in \
        capsys.readouterr().err
    changed = json.loads(bpe.read_text())  # the run's tokenizer file changed since: two ids swapped
    vocab = changed["model"]["vocab"]
    a, b = (next(token for token, idx in vocab.items() if idx == i) for i in (300, 301))
    vocab[a], vocab[b] = 301, 300
    bpe.write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="whose files have changed since"):
        load_model(ckpt, device=CPU)
    # the explicit file is checked against the record's vocabulary size only: the same size is taken
    assert load_model(ckpt, device=CPU, tokenizer=str(bpe))[1].vocab_size == 384


def test_byte_tokenizer_export_is_the_byte_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_json())
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    every_byte = bytes(range(256)).decode("latin-1") + "é€🤖\r\n\t "
    assert tok.encode_batch([every_byte])[0] == list(every_byte.encode())
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.decode(list(TEXT.encode())) == TEXT
