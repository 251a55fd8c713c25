"""A K3Model on one device from a moontrain checkpoint or a Hugging Face directory, for inference.

All experts live on the device (the local experts backend, EP=1; their fp32 masters are dropped after
the compute copies are made); weights are held in `dtype` (bf16 on GPU by default, fp32 on CPU) except
the routers', which stay fp32 as in training.
The tokenizer (moontrain.checkpoint.run_tokenizer): --tokenizer, else the one the checkpoint records or
the export holds; none known, or one whose vocabulary is not the model's, is refused, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moontrain.checkpoint.hf import CONFIG, read_hf
from moontrain.checkpoint.run_tokenizer import FIX, check_fits, explicit_tokenizer, tokenizer_of_checkpoint
from moontrain.checkpoint.store import MANIFEST, _model_tensors, open_checkpoint
from moontrain.checkpoint.tensors import CheckpointError
from moontrain.config.loader import from_dict
from moontrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from moontrain.model.config import KernelsConfig, ModelConfig, saved_model_dict
from moontrain.model.experts import ExpertsContext
from moontrain.model.transformer import K3Model


def load_model(path: str | Path, *, device: torch.device, dtype: torch.dtype | None = None,
               max_tokens: int = 4096, tokenizer: str | None = None, kernels: KernelsConfig | None = None
               ) -> tuple[K3Model, ByteTokenizer | HFTokenizer]:
    """(model in eval mode with the local experts backend, tokenizer) of a checkpoint or an HF directory.
    max_tokens: the most tokens one forward may route (batch x new tokens); tokenizer: --tokenizer; kernels:
    how the layers run (default KernelsConfig(): fla's KDA on CUDA when installed)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        state, source = open_checkpoint(path)
        cfg, prefix = from_dict(ModelConfig, saved_model_dict(state["model"]), "model"), "model."
        found = tokenizer_of_checkpoint(path, state, tokenizer)
        if found is None:
            raise ValueError(f"{path} was trained on synthetic Markov tokens (data.source=markov): it has no "
                             f"tokenizer; {FIX}")
        tok = found[1]
    elif (path / CONFIG).is_file():
        cfg, source = read_hf(path)
        prefix = ""
        tok = _export_tokenizer(path, tokenizer)
    else:
        raise CheckpointError(f"{path} is neither a moontrain checkpoint (no {MANIFEST}) nor a Hugging Face model "
                              f"directory (no {CONFIG})")
    check_fits(tok, cfg.vocab_size, path)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = K3Model(cfg, kernels=kernels, device=device)  # no document_eos_id: one sequence per row
    ctx = ExpertsContext(num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep=1,
                         compute_dtype=dtype, token_padding=16, max_tokens=max_tokens, device=device,
                         activation=cfg.ffn_activation)
    model.attach_experts_backends("local", ctx)
    with torch.no_grad():
        for name, t in _model_tensors(model).items():
            t.copy_(source.full(prefix + name))
        for moe in model.moe_layers():
            moe.experts.push_master()
            for master in moe.experts.master.values():  # the compute copies are all inference reads
                master.data = torch.empty(0, device=device)
        for name, p in model.named_parameters():
            if ".experts.master." not in name and ".router." not in name:  # routing stays fp32
                p.data = p.data.to(dtype)
    return model.eval(), tok


def _export_tokenizer(path: Path, explicit: str | None) -> ByteTokenizer | HFTokenizer:
    """An HF directory's own tokenizer (the byte tokenizer when config.json says moontrain_tokenizer: bytes), or
    --tokenizer with the same vocabulary size."""
    marked = json.loads((path / CONFIG).read_text()).get("moontrain_tokenizer")
    own: ByteTokenizer | HFTokenizer | None = None
    if marked == "bytes":
        own = ByteTokenizer()
    elif (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        own = load_tokenizer(str(path))
    if explicit is not None:
        return explicit_tokenizer(explicit, own.vocab_size if own is not None else None,
                                  f"its own tokenizer ({path})", path)
    if own is None:
        why = ("was trained on synthetic Markov tokens: it has no tokenizer" if marked == "none" else
               "holds no tokenizer (no tokenizer.json or tokenizer_config.json)")
        raise ValueError(f"{path} {why}; {FIX}")
    return own
