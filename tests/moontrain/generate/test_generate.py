"""Generation and evaluation from the command line.

References: decoding without the cache (the training forward over the whole sequence at every step)
for decoding with it, token for token; the training forward's logits for the cached prefill (fp32
rounding); a direct cross-entropy over the same batches for `moontrain eval`; the nucleus probabilities
for top-p sampling (a binomial bound).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moontrain.checkpoint import export_hf
from moontrain.cli import main
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.data.config import DataConfig
from moontrain.data.source import build_token_source
from moontrain.data.tokenizer import ByteTokenizer
from moontrain.generate.decoder import forward_cached, generate, new_cache, sample
from moontrain.generate.load import load_model
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import train

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
CORPUS = str(ROOT / "recipes/data/tiny_corpus.jsonl")


def _trainer(run_dir: Path, **model_over) -> Trainer:
    torch.set_num_threads(1)
    model = {**load_recipe(ROOT / "recipes/k3_tiny.yaml")["model"], **model_over}
    cfg = from_dict(RunConfig, {
        "model": model, "experts": {"backend": "local"}, "parallel": {"ep": 1},
        "train": {"steps": 3, "global_batch_size": 4, "seq_len": 32, "seed": 2, "run_dir": str(run_dir),
                  "log_every": 1},
        "data": {"source": "dataset", "path": CORPUS}, "metrics": {"wandb": False},
    })
    return Trainer(cfg, single_process_layout(CPU))


@pytest.mark.parametrize("variant", [
    {},
    {"rope_yarn": {"factor": 8.0, "original_max_position": 16, "mscale": 1.0, "mscale_all_dim": 0.7},
     "num_expert_groups": 4, "topk_expert_groups": 2, "q_lora_rank": None, "attn_output_gate": False},
    {"ffn_activation": "swiglu", "attn_res_block_size": 0},
    {"attn_res_block_size": 2},
], ids=["k3_tiny", "yarn_groups_fullrank_q", "swiglu_standard_residuals", "attn_res_block_per_layer"])
def test_greedy_with_cache_equals_without(tmp_path: Path, variant: dict) -> None:
    trainer = _trainer(tmp_path, **variant)
    train(trainer, 3)
    model = trainer.model.eval()
    tok = ByteTokenizer()
    prompts = [tok.encode("The quick brown fox"), tok.encode("Once upon a time, ")]
    prompt_BT = torch.tensor([p[:16] for p in prompts])
    with torch.no_grad():  # the cached prefill is the training forward
        cache = new_cache(model, 2, 16)
        got = forward_cached(model, prompt_BT, cache)
        ref = model.logits(prompt_BT)
        assert (got - ref).abs().max() <= 64 * torch.finfo(torch.float32).eps * ref.abs().max()
    cached = generate(model, prompt_BT, max_new_tokens=24)
    plain = generate(model, prompt_BT, max_new_tokens=24, use_cache=False)
    assert cached.shape == (2, 40)
    mismatch = (cached != plain).nonzero()
    assert mismatch.numel() == 0, f"first differing (row, position): {mismatch[0].tolist()}"
    # sampling: seeded, and a vanishing nucleus is greedy
    assert torch.equal(generate(model, prompt_BT, max_new_tokens=8, temperature=0.9, top_p=0.8, seed=4),
                       generate(model, prompt_BT, max_new_tokens=8, temperature=0.9, top_p=0.8, seed=4))
    assert torch.equal(generate(model, prompt_BT, max_new_tokens=8, temperature=1.0, top_p=1e-6), cached[:, :24])


def test_top_p_draws_from_the_nucleus() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]]).expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits, temperature=1.0, top_p=0.7, generator=gen)
    counts = torch.bincount(draws, minlength=4)
    assert counts[2:].sum() == 0  # 0.5 + 0.3 reach 0.7: the nucleus is the first two
    p0, n = 0.5 / 0.8, draws.numel()
    assert abs(counts[0].item() / n - p0) <= 5 * math.sqrt(p0 * (1 - p0) / n)


def test_cli_generate_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _trainer(tmp_path / "run")
    train(trainer, 3)
    ckpt = trainer.save_checkpoint()
    hf = export_hf(ckpt, tmp_path / "hf", dtype="float32")
    model, tok = load_model(ckpt, device=CPU)
    want = tok.decode(generate(model, torch.tensor([tok.encode("Hello")]), max_new_tokens=12, eos_id=tok.eos_id)[0]
                      .tolist())
    for source in (ckpt, hf):  # the checkpoint and its fp32 export decode the same text
        assert main(["generate", str(source), "--prompt", "Hello", "--max-new-tokens", "12", "--device", "cpu"]) == 0
        out = capsys.readouterr().out
        assert out == want + "\n" and out.startswith("Hello"), (source, out, want)

    assert main(["eval", str(ckpt), "--data", CORPUS, "--seq-len", "32", "--batch-size", "2", "--batches", "3",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    data = build_token_source(DataConfig(source="dataset", path=CORPUS, shuffle=False), vocab_size=257, seq_len=32,
                              global_batch=2, rank=0, world_size=1)
    with torch.no_grad():
        losses = []
        for step in range(3):
            tokens, targets = data.batch(step)
            logits = trainer.model.logits(tokens)
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item())
    loss = sum(losses) / 3
    assert printed.startswith(f"loss {loss:.4f}  perplexity {math.exp(loss):.3f}  (192 tokens)"), printed
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a moontrain checkpoint" in capsys.readouterr().err
