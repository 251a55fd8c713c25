"""The tokenizer a model was trained with: remembered by its checkpoints, written into its exports under the
names Hugging Face looks for, and found again (never guessed) by `moontrain generate` / `moontrain eval`.

Checkpoints: train_state.json holds `tokenizer`, the run's data.tokenizer as a record (data.tokenizer's
tokenizer_record: `bytes`, or the absolute path with the vocabulary size, EOS id and the sha256 of its
files); null for synthetic Markov tokens, which have no tokenizer. A checkpoint from before the record:
the run's config.yaml beside its checkpoints directory (data.source, data.tokenizer, data.eos_id).

Exports: `tokenizer.json` (the run's tokenizer file under that name whatever it was called, or the files
of a tokenizer directory; for the byte tokenizer a byte-level BPE without merges whose id b is byte b and
256 is <|endoftext|>) and `tokenizer_config.json` (bos and eos token, model_max_length), so
AutoTokenizer.from_pretrained(OUT) loads it. config.json says `moontrain_tokenizer: bytes` for the byte
tokenizer (moontrain then decodes with its own ByteTokenizer) and `none` for synthetic tokens.

Which tokenizer reads a model (generate/load.py): an explicit --tokenizer, which must have the vocabulary
size of the model's own tokenizer when that is known; else the checkpoint's record (its files must still be
there, unchanged) or the export's tokenizer files. When none is known the command stops and asks for
--tokenizer. Always: the tokenizer's ids must fit the model's vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from moontrain.data.tokenizer import (
    TOKENIZER_FILES,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    tokenizer_digest,
    tokenizer_files,
)

EOS_TEXT = "<|endoftext|>"  # the byte tokenizer's id 256 in an export's tokenizer.json
FIX = "pass --tokenizer PATH (the tokenizer.json or tokenizer directory the model was trained with)"


def checkpoint_tokenizer(checkpoint: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """The record of the tokenizer a checkpoint's run used; None: synthetic tokens, no tokenizer."""
    if "tokenizer" in state:
        return state["tokenizer"]
    run_config = checkpoint.resolve().parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ValueError(f"checkpoint {checkpoint} does not record its tokenizer and has no run config.yaml beside "
                         f"its checkpoints directory; {FIX}")
    data = yaml.safe_load(run_config.read_text()).get("data") or {}
    if data.get("source", "markov") == "markov":
        return None
    return {"spec": data.get("tokenizer", "bytes"), "eos_id": data.get("eos_id")}


def tokenizer_of_checkpoint(checkpoint: Path, state: dict[str, Any], explicit: str | None
                            ) -> tuple[str, ByteTokenizer | HFTokenizer] | None:
    """(spec, tokenizer) that goes with a checkpoint: `explicit` (--tokenizer; refused when the checkpoint records
    a tokenizer of another vocabulary size), else the recorded one; None: synthetic tokens, no tokenizer."""
    if explicit is None:
        record = checkpoint_tokenizer(checkpoint, state)
        return (record["spec"], load_recorded(record, checkpoint)) if record is not None else None
    try:
        record = checkpoint_tokenizer(checkpoint, state) or {}
    except ValueError:  # an older checkpoint that does not say: the explicit one is all there is
        record = {}
    return explicit, explicit_tokenizer(explicit, record.get("vocab_size"), record.get("spec", ""), checkpoint)


def load_recorded(record: dict[str, Any], model: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a record, refused when its files are gone or have changed since the run."""
    spec = record["spec"]
    if spec != "bytes":
        if not Path(spec).exists():
            raise ValueError(f"{model} was trained with the tokenizer {spec}, which is not there any more; {FIX}")
        if "sha256" in record and tokenizer_digest(spec) != record["sha256"]:
            raise ValueError(f"{model} was trained with the tokenizer {spec}, whose files have changed since (their "
                             f"sha256 differs from the checkpoint's record); {FIX}")
    return load_tokenizer(spec, eos_id=record.get("eos_id"))


def explicit_tokenizer(spec: str, own_vocab: int | None, own_name: str, model: str | Path
                       ) -> ByteTokenizer | HFTokenizer:
    """--tokenizer `spec`, refused when the model's own tokenizer (`own_name`, `own_vocab` ids) is known and
    has another vocabulary size."""
    tokenizer = load_tokenizer(spec)
    if own_vocab is not None and tokenizer.vocab_size != own_vocab:
        raise ValueError(f"--tokenizer {spec} has {tokenizer.vocab_size} ids, but {model} was trained with "
                         f"{own_name} ({own_vocab} ids); pass that tokenizer, or leave --tokenizer out")
    return tokenizer


def check_fits(tokenizer: ByteTokenizer | HFTokenizer, model_vocab: int, model: str | Path) -> None:
    if tokenizer.vocab_size > model_vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the vocabulary of {model} "
                         f"({model_vocab}): it is not the model's tokenizer; {FIX}")


def write_export_tokenizer(out_dir: Path, spec: str, tokenizer: ByteTokenizer | HFTokenizer, *,
                           max_length: int) -> list[str]:
    """tokenizer.json (+ the other files of a tokenizer directory) and tokenizer_config.json into an export;
    returns the names written."""
    config: dict[str, Any] = {}
    if spec == "bytes":
        (out_dir / "tokenizer.json").write_text(byte_tokenizer_json())
        eos = EOS_TEXT
    else:
        for f in tokenizer_files(spec):
            if f.name == "tokenizer_config.json":
                config = json.loads(f.read_text())
            else:
                shutil.copyfile(f, out_dir / ("tokenizer.json" if Path(spec).is_file() else f.name))
        assert isinstance(tokenizer, HFTokenizer)
        eos = tokenizer.token(tokenizer.eos_id)
    if not config:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    # the packer puts EOS between documents, so a document starts after one: it is the BOS as well
    config.setdefault("eos_token", eos)
    config.setdefault("bos_token", eos)
    config.setdefault("model_max_length", max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return sorted(f.name for f in out_dir.iterdir() if f.name in TOKENIZER_FILES)


def byte_chars() -> list[str]:
    """The printable character that stands for each byte in a byte-level BPE vocabulary (the GPT-2
    convention the `tokenizers` ByteLevel pre-tokenizer uses): printable Latin-1 bytes stand for
    themselves, the others for 256, 257, ... in byte order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def byte_tokenizer_json() -> str:
    """moontrain's byte tokenizer as a tokenizer.json: ids 0-255 are the bytes, 256 is <|endoftext|>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
    return tok.to_str(pretty=True)
