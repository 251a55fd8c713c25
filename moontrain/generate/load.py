"""A K3Model on one device from a moontrain checkpoint or a Hugging Face directory, for inference.

All experts live on the device (the local experts backend, EP=1); the dense weights keep their fp32
values and the experts compute in `dtype` (bf16 on GPU by default, fp32 on CPU), as in training.
The tokenizer: the run's (config.yaml next to the checkpoints directory, data.tokenizer), the
directory's tokenizer.json, or moontrain's byte tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import yaml

from moontrain.checkpoint.hf import CONFIG, read_hf
from moontrain.checkpoint.store import MANIFEST, _model_tensors, open_checkpoint
from moontrain.checkpoint.tensors import CheckpointError
from moontrain.config.loader import from_dict
from moontrain.data.tokenizer import ByteTokenizer
from moontrain.model.config import ModelConfig
from moontrain.model.experts import ExpertsContext
from moontrain.model.transformer import K3Model


class Tokenizer(Protocol):
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class FileTokenizer:
    """A tokenizers-library tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.inner = _Tokenizer.from_file(str(path))
        self.eos_id = None

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)


def load_model(path: str | Path, *, device: torch.device, dtype: torch.dtype | None = None,
               max_tokens: int = 4096) -> tuple[K3Model, Tokenizer]:
    """(model in eval mode with the local experts backend, tokenizer) of a checkpoint or an HF directory.
    max_tokens: the most tokens one forward may route (batch x new tokens)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        state, source = open_checkpoint(path)
        cfg, prefix = from_dict(ModelConfig, state["model"], "model"), "model."
        tokenizer = _run_tokenizer(path)
    elif (path / CONFIG).is_file():
        cfg, source = read_hf(path)
        prefix = ""
        tokenizer = FileTokenizer(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else ByteTokenizer()
    else:
        raise CheckpointError(f"{path} is neither a moontrain checkpoint (no {MANIFEST}) nor a Hugging Face model "
                              f"directory (no {CONFIG})")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = K3Model(cfg, device=device)
    ctx = ExpertsContext(num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep_size=1,
                         compute_dtype=dtype, token_padding=16, max_tokens=max_tokens, device=device,
                         activation=cfg.ffn_activation)
    model.attach_experts_backends("local", ctx)
    with torch.no_grad():
        for name, t in _model_tensors(model).items():
            t.copy_(source.full(prefix + name))
        for moe in model.moe_layers():
            moe.experts.push_master()
    return model.eval(), tokenizer


def _run_tokenizer(checkpoint: Path) -> Tokenizer:
    run_config = checkpoint.resolve().parent.parent / "config.yaml"
    name = "bytes"
    if run_config.is_file():
        name = (yaml.safe_load(run_config.read_text()).get("data") or {}).get("tokenizer", "bytes")
    if name == "bytes":
        return ByteTokenizer()
    path = Path(name)
    return FileTokenizer(path if path.is_file() else path / "tokenizer.json")
