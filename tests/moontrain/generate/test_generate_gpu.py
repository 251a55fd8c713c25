"""Generation on one GPU: greedy decoding with the MLA cache equals decoding without it (fp32 compute,
token for token), and in bf16 the cached prefill's logits equal the training forward's within bf16
rounding. Reference: the training forward (K3Model.logits) on the same device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.data.tokenizer import ByteTokenizer
from moontrain.generate.decoder import forward_cached, generate, new_cache
from moontrain.generate.load import load_model
from moontrain.model.config import KernelsConfig
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cached_decoding_on_gpu(tmp_path: Path, dtype: torch.dtype) -> None:
    cfg = from_dict(RunConfig, {
        # the KDA layers through the PyTorch chunked form: fla's kernel computes in bf16 whatever the input
        # dtype, which the fp32 comparisons below would measure instead of the cache
        "model": load_recipe(ROOT / "recipes/k3_tiny.yaml")["model"],
        "experts": {"backend": "local"},
        "parallel": {"ep": 1}, "train": {"steps": 1, "global_batch_size": 2, "seq_len": 16, "run_dir": str(tmp_path)},
        "metrics": {"wandb": False},
    })
    ckpt = Trainer(cfg, single_process_layout(torch.device("cpu"))).save_checkpoint()
    dev = torch.device("cuda")
    model, _ = load_model(ckpt, device=dev, dtype=dtype, tokenizer="bytes",  # trained on Markov tokens
                          kernels=KernelsConfig(kda="torch"))
    tok = ByteTokenizer()
    first = tok.encode("The quick brown fox")
    prompt = torch.tensor([first, tok.encode("Once upon a time, there")[:len(first)]], device=dev)
    with torch.no_grad():
        got = forward_cached(model, prompt, new_cache(model, 2, prompt.shape[1]))
        ref = model.logits(prompt)
    eps = torch.finfo(dtype).eps
    assert (got - ref).abs().max() <= 64 * eps * ref.abs().max()
    if dtype == torch.float32:
        cached = generate(model, prompt, max_new_tokens=32)
        plain = generate(model, prompt, max_new_tokens=32, use_cache=False)
        assert torch.equal(cached, plain), (cached != plain).nonzero()[0].tolist()
