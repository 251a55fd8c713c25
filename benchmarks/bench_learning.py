"""Learning on real text: does moontrain's loss fall as a reference trainer's does, with healthy routing?

    torchrun --nproc_per_node=1 benchmarks/bench_learning.py --setup dsv3 --steps 60
    torchrun --nproc_per_node=1 benchmarks/bench_learning.py --setup k3_small --steps 60
    torchrun --nproc_per_node=1 benchmarks/bench_learning.py --setup dsv3 --steps 20 --init previous
    torchrun --nproc_per_node=1 benchmarks/bench_learning.py --setup reference --steps 50
    python benchmarks/bench_learning.py --show benchmarks/results/bench_learning_<...>.json

Data: recipes/data/learning (generated text of Zipf-distributed pseudo-words, 2 MiB, and its byte-level
BPE of 30,922 ids; unigram entropy 7.26 nats per token: a model that uses no context stays there).

Setups (trailing key=value arguments override the recipe):
- dsv3: k3_small_moe's widths as a DeepSeek-V3 block (8 layers, hidden 2048, all-MLA with rope, no
  output gate, 96 routed experts top-8 + 2 shared, vocab 32768; 4.55 B parameters), one GPU (EP = 1),
  131,072 tokens per step (4 passes of 8 x 4096), AdamW 6e-4, warmup 5, cosine to 0.1, clip 1.0: the setup torchtitan 0.2.2
  was measured on (loss 10.84 at step 1, 5.20 at step 20, 3.85 at step 60; recipes/data/learning/README).
- k3_small: the K3 block (12 KDA + 4 gated NoPE MLA, SiTU-GLU, AttnRes, latent MoE, E = 64) with the
  recipe's own batch at EP = 1.
- reference: moontrain against benchmarks/reference_loop.py (a plain loop over transformers'
  DeepseekV3ForCausalLM) from the same weights on the same batches, both in bf16 on the GPU; a smaller
  DeepSeek-V3 (hidden 1024, 4 layers, 32 experts top-4, 16 x 1024 tokens per step). The two curves
  agree loosely (bf16 rounding of two different implementations): the table prints both.

--init previous re-draws the weights with the scheme before docs/learning.md's fix (every matrix and the
embedding N(0, 0.02^2)); --init embed_only is that scheme with the embedding at N(0, 1) alone. They are
the before rows of docs/learning.md.

Per step: loss, grad norm, max expert maxvio over the MoE layers, learning rate, step time (device
synchronised). Summary: loss at steps 20 and 60 (when run), max maxvio from step 20 on, median tokens/s
over the steps after the fifth (compile and autotune excluded). Writes
<out>/bench_learning_<setup>_<init>_<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.worker import select_device

ROOT = Path(__file__).resolve().parents[1]
LEARNING = ROOT / "recipes/data/learning"
UNIGRAM_NATS = 7.26  # the corpus's unigram entropy over the tokenizer's ids (recipes/data/learning/README.md)
DSV3 = ["model.num_experts=96", "model.attn_output_gate=false", "model.moe_latent_size=null",
        "model.kda_layers_per_mla=0", "model.use_nope=false", "parallel.dense=plain", "train.micro_batch_size=8"]
SETUPS = {
    "dsv3": ("recipes/k3_small_moe.yaml", DSV3),
    "k3_small": ("recipes/k3_small.yaml", []),
}
TORCHTITAN = {"dsv3": {20: 5.20, 60: 3.85}}  # torchtitan 0.2.2 on one H200, same model, data and schedule


def learning_data(path: Path = LEARNING) -> list[str]:
    return ["data.source=dataset", f"data.path={path / 'corpus.jsonl'}", f"data.tokenizer={path / 'tokenizer'}"]


@torch.no_grad()
def previous_init(trainer: Trainer, embed_std: float | None = None) -> None:
    """The scheme before the fix: norms 1, AttnRes queries 0, KDA's own parameters as initialised, every
    other matrix, the embedding and the experts N(0, init_std^2); embed_std re-draws the embedding alone."""
    model, cfg = trainer.model, trainer.cfg
    gen = torch.Generator(device=model.embed.weight.device).manual_seed(cfg.train.seed)
    std = cfg.model.init_std
    for name, p in model.named_parameters():
        special = name.endswith(("norm.weight", ".query", ".A_log", ".dt_bias", "_conv1d"))
        if ".experts.master." in name or special:
            continue
        p.normal_(0.0, std, generator=gen)
    for w in trainer.experts:
        for master in w.master.values():
            master.normal_(0.0, std, generator=gen)
        w.push_master()
    if embed_std is not None:
        model.embed.weight.normal_(0.0, embed_std, generator=gen)


def run_moontrain(cfg: RunConfig, layout, init: str, log) -> list[dict]:
    trainer = Trainer(cfg, layout)
    if init == "previous":
        previous_init(trainer)
    elif init == "embed_only":
        previous_init(trainer, embed_std=1.0)
    device = layout.device
    rows = []
    try:
        for _ in range(cfg.train.steps):
            _sync(device)
            t0 = time.perf_counter()
            stats = trainer.train_step()
            _sync(device)
            row = {"step": stats.step, "loss": stats.loss, "grad_norm": stats.grad_norm, "maxvio": stats.max_maxvio,
                   "lr": stats.lr, "step_s": time.perf_counter() - t0}
            rows.append(row)
            log(row)
    finally:
        trainer.close()
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(rows: list[dict], tokens_per_step: int) -> dict:
    by_step = {r["step"]: r for r in rows}
    late = [r["maxvio"] for r in rows if r["step"] >= 20]
    timed = [r["step_s"] for r in rows[5:]] or [r["step_s"] for r in rows]
    return {"loss_step1": rows[0]["loss"], "loss_step20": by_step.get(20, {}).get("loss"),
            "loss_step60": by_step.get(60, {}).get("loss"), "loss_last": rows[-1]["loss"],
            "max_maxvio_from_step20": max(late) if late else None, "max_maxvio": max(r["maxvio"] for r in rows),
            "median_step_s": statistics.median(timed), "tokens_per_s": tokens_per_step / statistics.median(timed)}


def reference_run(args: argparse.Namespace, layout, log) -> dict:
    """moontrain and benchmarks/reference_loop.py from the same transformers-initialised weights."""
    import transformers

    from benchmarks.reference_loop import LoopConfig, batches, token_stream
    from benchmarks.reference_loop import train as reference_train
    from moontrain.checkpoint import init_weights_from, read_hf
    from moontrain.config.loader import to_dict
    from moontrain.data.tokenizer import load_tokenizer

    device = layout.device
    if args.tiny:  # a CPU check of the code path, not a measurement
        B, T, lr, widths = 4, 64, 3e-3, dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                             kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                                             qk_nope_head_dim=16, n_routed_experts=8, num_experts_per_tok=2)
    else:
        B, T, lr, widths = 16, 1024, 6e-4, dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                                kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
                                                qk_nope_head_dim=128, n_routed_experts=32, num_experts_per_tok=4)
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=32768, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, max_position_embeddings=T, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False, **widths)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench_learning_"))
    transformers.DeepseekV3ForCausalLM(hf_cfg).save_pretrained(work / "hf")
    mcfg, _ = read_hf(work / "hf")
    model = {**to_dict(mcfg), "router_bias_update_rate": 1e-2, "router_bias_update": "proportional"}
    cfg = from_dict(RunConfig, {
        "model": model, "experts": {"backend": "moonep"}, "parallel": {"ep": 1, "dense": "plain"},
        "optim": {"lr": lr, "warmup_steps": 5, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"steps": args.steps, "global_batch_size": B, "seq_len": T, "seed": 0, "log_every": 1,
                  "run_dir": str(work / "run")},
        "data": {"source": "dataset", "path": str(LEARNING / "corpus.jsonl"), "tokenizer": str(LEARNING / "tokenizer"),
                 "shuffle": False},
        "checkpoint": {"save_final": False}, "metrics": {"wandb": False}})
    trainer = Trainer(cfg, layout)
    init_weights_from(trainer.state, work / "hf")
    trainer.model.document_eos_id = None  # transformers' model reads each row as one sequence
    mine = []
    try:
        for _ in range(args.steps):
            stats = trainer.train_step()
            mine.append({"step": stats.step, "loss": stats.loss, "maxvio": stats.max_maxvio})
    finally:
        trainer.close()
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(work / "hf", dtype=torch.float32).to(device)
    tok = load_tokenizer(str(LEARNING / "tokenizer"))
    stream = token_stream(LEARNING / "corpus.jsonl", lambda s: tok.encode_batch([s])[0], tok.eos_id)
    ref = reference_train(hf, batches(stream, B, T), LoopConfig(lr=lr, warmup_steps=5, steps=args.steps, batch=B,
                                                                 seq_len=T),
                          device=device, autocast_dtype=torch.bfloat16 if device.type == "cuda" else None)
    rows = []
    for m, r in zip(mine, ref, strict=True):
        row = {"step": m["step"], "loss": m["loss"], "reference_loss": r["loss"], "maxvio": m["maxvio"],
               "reference_maxvio": r["maxvio"]}
        rows.append(row)
        log(row)
    diffs = [abs(r["loss"] - r["reference_loss"]) for r in rows]
    return {"rows": rows, "summary": {"max_abs_loss_diff": max(diffs), "final_loss": rows[-1]["loss"],
                                      "final_reference_loss": rows[-1]["reference_loss"],
                                      "mean_abs_loss_diff": statistics.mean(diffs)}}


def print_table(result: dict) -> None:
    setup, rows = result["setup"], result["rows"]
    print(f"\n{setup} ({result.get('init', '')}) on {result['device']}:")
    if setup == "reference":
        print(f"{'step':>5} {'moontrain':>10} {'reference':>10} {'maxvio':>7} {'ref maxvio':>10}")
        for r in rows:
            print(f"{r['step']:>5} {r['loss']:>10.4f} {r['reference_loss']:>10.4f} {r['maxvio']:>7.2f} "
                  f"{r['reference_maxvio']:>10.2f}")
    else:
        print(f"{'step':>5} {'loss':>8} {'maxvio':>7} {'grad':>8} {'lr':>9} {'ms':>8}")
        for r in rows:
            if r["step"] <= 10 or r["step"] % 5 == 0:
                print(f"{r['step']:>5} {r['loss']:>8.3f} {r['maxvio']:>7.2f} {r['grad_norm']:>8.2f} {r['lr']:>9.2e} "
                      f"{1e3 * r['step_s']:>8.0f}")
    print("summary:", json.dumps(result["summary"]))
    if setup in TORCHTITAN:
        print("torchtitan 0.2.2, same setup:", TORCHTITAN[setup])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=[*SETUPS, "reference"], default="dsv3")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--init", choices=["default", "previous", "embed_only"], default="default")
    p.add_argument("--data", default=str(LEARNING), help="folder with corpus.jsonl and tokenizer/")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    p.add_argument("--tiny", action="store_true", help="reference setup at toy widths (a CPU check of the code path)")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved result and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    if args.show:
        print_table(json.loads(Path(args.show).read_text()))
        return
    device, backend = select_device()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        run(args, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> None:
    layout = build_layout(1, device)

    def log(row: dict) -> None:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    result = {"setup": args.setup, "init": args.init, "steps": args.steps, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d")}
    if args.setup == "reference":
        result.update(reference_run(args, layout, log))
    else:
        recipe, overrides = SETUPS[args.setup]
        run_dir = tempfile.mkdtemp(prefix="bench_learning_")
        overrides = [*overrides, *learning_data(Path(args.data)), "parallel.ep=1", f"train.steps={args.steps}",
                     "train.log_every=1", f"train.run_dir={run_dir}", "checkpoint.save_final=false",
                     "checkpoint.every=0", "checkpoint.resume=none", "metrics.wandb=false", *args.overrides]
        cfg = from_dict(RunConfig, load_recipe(ROOT / recipe, overrides))
        result.update(recipe=recipe, overrides=overrides)
        rows = run_moontrain(cfg, layout, args.init, log)
        result.update(rows=rows, summary=summary(rows, cfg.train.global_batch_size * cfg.train.seq_len),
                      unigram_nats=UNIGRAM_NATS, torchtitan=TORCHTITAN.get(args.setup))
    tag = f"_{args.tag}" if args.tag else ""
    path = Path(args.out) / f"bench_learning_{args.setup}_{args.init}{tag}_{time.strftime('%Y%m%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
