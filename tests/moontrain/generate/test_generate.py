"""Generation and evaluation from the command line.

References: decoding without the cache (the training forward over the whole sequence at every step)
for decoding with it, token for token; the training forward's logits for the cached prefill (fp32
rounding); a direct cross-entropy over the same batches for `moontrain eval`; the nucleus probabilities
for top-p sampling (a binomial bound).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moontrain.checkpoint import export_hf
from moontrain.cli import main
from moontrain.config import RunConfig, from_dict, load_recipe
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
    {"kda_layers_per_mla": 1, "kda_num_heads": 2, "kda_head_dim": 16, "kda_gate_rank": 8},
], ids=["k3_tiny", "yarn_groups_fullrank_q", "swiglu_standard_residuals", "attn_res_block_per_layer", "kda_hybrid"])
def test_greedy_with_cache_equals_without(tmp_path: Path, variant: dict) -> None:
    trainer = _trainer(tmp_path, **variant)
    train(trainer, 3)
    model = trainer.model.eval()
    model.document_eos_id = None  # decoding continues one sequence per row, EOS or not
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
    stream = []  # the documents in file order, back to back with EOS, cut into rows of 33 with stride 32
    for line in Path(CORPUS).read_text().splitlines():
        stream += [*ByteTokenizer().encode(json.loads(line)["text"]), ByteTokenizer.eos_id]
    rows = torch.tensor(stream[:3 * 2 * 32 + 1]).unfold(0, 33, 32).view(3, 2, 33)
    with torch.no_grad():
        losses = []
        for batch in rows:
            logits = trainer.model.logits(batch[:, :-1])
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).item())
    loss = sum(losses) / 3
    # "loss L  perplexity P  (192 tokens of FILE: the first 3 batches of N tokens)": L to 4 decimals, P to 3
    words = printed.split()
    assert words[0] == "loss" and words[2] == "perplexity" and words[4] == "(192", printed
    assert f"the first 3 batches of {len(stream) - 1:,} tokens)" in printed, printed
    assert abs(float(words[1]) - loss) <= 5e-5 + 1e-5 * loss, (printed, loss)
    assert abs(float(words[3]) - math.exp(loss)) <= 5e-4 + 1e-5 * math.exp(loss), (printed, loss)
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a moontrain checkpoint" in capsys.readouterr().err


def test_eval_reads_every_held_out_token_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _trainer(tmp_path / "run")
    train(trainer, 3)
    ckpt = trainer.save_checkpoint()
    heldout = tmp_path / "heldout.jsonl"  # the first documents of the shipped held-out set, ~2,600 tokens
    lines = (ROOT / "recipes/data/tiny_heldout.jsonl").read_text().splitlines()
    heldout.write_text("".join(line + "\n" for line in lines[:len(lines) // 10]))
    stream = []  # the held-out documents in file order, back to back with EOS: every token but the first a target
    for line in heldout.read_text().splitlines():
        stream += [*ByteTokenizer().encode(json.loads(line)["text"]), ByteTokenizer.eos_id]
    T = 512  # the default --seq-len: full rows of T + 1 with stride T, then the remainder as one shorter row
    full = (len(stream) - 1) // T
    rows = [torch.tensor(stream[i * T:i * T + T + 1]) for i in range(full)] + [torch.tensor(stream[full * T:])]
    ce_sum = 0.0
    trainer.model.document_eos_id = None  # one sequence per row, as the loaded model reads it
    with torch.no_grad():
        for row in rows:
            logits = trainer.model.logits(row[None, :-1])
            ce_sum += F.cross_entropy(logits.double().flatten(0, 1), row[1:], reduction="sum").item()
    loss = ce_sum / (len(stream) - 1)
    assert main(["eval", str(ckpt), "--data", str(heldout), "--device", "cpu"]) == 0  # the defaults
    printed = capsys.readouterr().out
    assert f"({len(stream) - 1:,} tokens of {heldout}: every token once)" in printed, printed
    assert abs(float(printed.split()[1]) - loss) <= 5e-5 + 1e-5 * loss, (printed, loss)
    # more batches than the file holds: refused, not read around again
    assert main(["eval", str(ckpt), "--data", str(heldout), "--batches", "1", "--device", "cpu"]) == 2
    assert f"ask for 4,096 tokens, but {heldout} holds {len(stream) - 1:,}; lower --batches" in capsys.readouterr().err
