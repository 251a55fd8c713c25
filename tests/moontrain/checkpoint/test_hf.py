"""Hugging Face export and import.

References: moontrain's own forward (K3Model.logits) for the transformers-loaded export, the canonical
state of the run that was exported (import must reproduce it bit for bit at another EP degree), and
transformers' DeepseekV3ForCausalLM for the DeepSeek-V3 import. Logit tolerances are fp32 rounding:
the two sides run the same math in fp32 and differ only in the order of a few sums (expert outputs,
attention), so |diff| <= 64 ulp of the largest logit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moontrain.checkpoint import CheckpointError, export_hf, init_weights_from, read_hf
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.config.loader import to_dict
from moontrain.generate.decoder import generate
from moontrain.model.config import ModelConfig
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, train

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
FP32_ULPS = 64


def _run_config(model: dict, backend: str, ep: int, run_dir: str, **checkpoint) -> RunConfig:
    return from_dict(RunConfig, {
        "model": model, "experts": {"backend": backend}, "parallel": {"ep": ep},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": 2, "global_batch_size": 4, "seq_len": 16, "seed": 3, "run_dir": run_dir, "log_every": 1},
        "checkpoint": checkpoint, "metrics": {"wandb": False},
    })


def _tiny_model() -> dict:
    return load_recipe(ROOT / "recipes/k3_tiny.yaml")["model"]


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    tol = FP32_ULPS * torch.finfo(torch.float32).eps * ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= tol, f"{what}: max |diff| {err:.3e} > {tol:.3e} (fp32 rounding of the largest logit)"


def _export_tiny(tmp_path: Path) -> tuple[Trainer, Path]:
    torch.set_num_threads(1)
    trainer = Trainer(_run_config(_tiny_model(), "local", 1, str(tmp_path / "run")), single_process_layout(CPU))
    train(trainer, 2)
    trainer.model.document_eos_id = None  # one sequence per row, as the HF model reads it
    with torch.no_grad():  # a nonzero router bias, so the exported bias is checked too
        for i, moe in enumerate(trainer.model.moe_layers()):
            moe.router.score_bias_E.copy_(torch.linspace(-0.05, 0.05, moe.router.num_experts) * (i + 1))
    return trainer, trainer.save_checkpoint()


def _import_at_ep2(rank: int, world: int, model_dir: str, run_dir: str) -> dict:
    cfg = _run_config(_tiny_model(), "alltoall", 2, run_dir, init_from=model_dir)
    trainer = Trainer(cfg, build_layout(2, CPU))
    init_weights_from(trainer.state, cfg.checkpoint.init_from)
    state = full_state(trainer)
    trainer.close()
    return state


def test_export_transformers_parity_and_import_at_ep2(tmp_path: Path) -> None:
    """k3_tiny checkpoint -> export -> AutoModelForCausalLM (trust_remote_code) -> the same logits ->
    import into a new run at EP=2 -> bitwise the exported parameters."""
    trainer, ckpt = _export_tiny(tmp_path)
    out = export_hf(ckpt, tmp_path / "hf32", dtype="float32", shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    for file in shards:  # a shard over the bound holds a single tensor
        with safe_open(str(out / file), framework="pt") as fh:
            assert (out / file).stat().st_size <= 64 * 1024 + 4096 or len(list(fh.keys())) == 1, file
    names = set(index["weight_map"])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.2.self_attn.q_b_proj.weight", "model.layers.2.self_attn.g_proj.weight",
                 "model.layers.1.self_attn.q_conv1d.weight", "model.layers.1.self_attn.A_log",
                 "model.layers.1.self_attn.f_proj.weight",  # k3_tiny: KDA, KDA, then MLA
                 "model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
                 "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.latent_down_proj.weight"):
        assert name in names, name
    _check_expert_layout(trainer, out, index["weight_map"])

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    assert model.dtype == torch.float32
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = trainer.model.logits(tokens)
        _close(model(tokens).logits, ref, "fp32 export vs moontrain")
    hf_greedy = model.generate(tokens[:, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(hf_greedy, generate(trainer.model, tokens[:, :8], max_new_tokens=8))

    # bf16 export: the weights rounded to bf16, read at fp32, compute the logits of moontrain's model
    # holding the same rounded weights
    out16 = export_hf(ckpt, tmp_path / "hf16")
    model16 = transformers.AutoModelForCausalLM.from_pretrained(str(out16), trust_remote_code=True,
                                                                dtype=torch.float32)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if not name.endswith("router.weight"):
                p.copy_(p.to(torch.bfloat16))
        for moe in trainer.model.moe_layers():
            moe.experts.push_master()
        _close(model16(tokens).logits, trainer.model.logits(tokens), "bf16 export vs moontrain (bf16 weights)")

    want = {k: v for k, v in full_state(_reload_single(tmp_path, ckpt)).items() if "exp_avg" not in k
            and not k.endswith(".step")}
    got = run_ranks(_import_at_ep2, 2, str(out), str(tmp_path / "ep2"))[0]
    assert_bitwise(got, want, "fp32 export -> import at EP=2")


def _check_expert_layout(trainer: Trainer, out: Path, weight_map: dict[str, str]) -> None:
    """fp32 export: every expert's gate_proj / up_proj [F, H] are gate_up's halves transposed and down_proj
    [H, F] is down transposed, bitwise; read back, gate_up [E, H, 2F] and any rows of it are the master's."""
    _, source = read_hf(out)
    moe_layers = [i for i, block in enumerate(trainer.model.layers) if hasattr(block.ffn, "experts")]
    assert moe_layers == [1, 2], moe_layers
    for i in moe_layers:
        block = trainer.model.layers[i]
        experts = block.ffn.experts
        F = experts.intermediate
        gate_up, down = experts.master["gate_up"].detach(), experts.master["down"].detach()
        prefix = f"model.layers.{i}.mlp.experts"
        want = {}
        for j in range(gate_up.shape[0]):
            want[f"{prefix}.{j}.gate_proj.weight"] = gate_up[j, :, :F].t()
            want[f"{prefix}.{j}.up_proj.weight"] = gate_up[j, :, F:].t()
            want[f"{prefix}.{j}.down_proj.weight"] = down[j].t()
        got = {}
        for name in want:
            with safe_open(str(out / weight_map[name]), "pt") as fh:
                got[name] = fh.get_tensor(name)
        assert_bitwise(got, {k: v.contiguous() for k, v in want.items()}, f"layer {i} experts exported")
        key = f"layers.{i}.ffn.experts.master.gate_up"
        assert source.shape(key) == tuple(gate_up.shape) == (gate_up.shape[0], trainer.model.cfg.expert_width, 2 * F)
        assert_bitwise({"all": source.full(key), "rows 3..5": source.rows(key, 3, 2), "none": source.rows(key, 5, 0)},
                       {"all": gate_up, "rows 3..5": gate_up[3:5], "none": gate_up[:0]}, f"layer {i} gate_up read back")


def _reload_single(tmp_path: Path, ckpt: Path) -> Trainer:
    trainer = Trainer(_run_config(_tiny_model(), "local", 1, str(tmp_path / "again")), single_process_layout(CPU))
    trainer.load_checkpoint(ckpt)
    return trainer


def test_import_refuses_another_architecture(tmp_path: Path) -> None:
    _, ckpt = _export_tiny(tmp_path)
    out = export_hf(ckpt, tmp_path / "hf")
    other = {**_tiny_model(), "num_heads": 2}
    trainer = Trainer(_run_config(other, "local", 1, str(tmp_path / "b")), single_process_layout(CPU))
    with pytest.raises(CheckpointError, match=r"model.num_heads \(4 vs 2\)"):
        init_weights_from(trainer.state, out)
    cfg, _ = read_hf(out)
    assert to_dict(cfg) == to_dict(from_dict(ModelConfig, _tiny_model(), "model"))


# ------------------------------------------------------------------------------------------ DeepSeek-V3
def _deepseek(tmp_path: Path):
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
        num_mtp_layers=0, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.8})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
            layer.mlp.gate.weight.normal_(0.0, 0.2)  # spread the router scores so the groups matter
    model.save_pretrained(tmp_path / "ds")
    return model


def test_deepseek_v3_import_matches_transformers(tmp_path: Path) -> None:
    """A DeepseekV3ForCausalLM with YaRN (both mscales) and group-limited routing, saved by transformers,
    imported: the same logits within fp32 rounding (the rope rows de-interleaved on import)."""
    ds = _deepseek(tmp_path)
    cfg, _ = read_hf(tmp_path / "ds")
    assert cfg.rope_yarn is not None and cfg.rope_yarn.mscale_all_dim == 0.8
    assert (cfg.num_expert_groups, cfg.topk_expert_groups, cfg.mla_eps, cfg.norm_eps) == (4, 2, 1e-6, 1e-5)
    assert not cfg.attn_output_gate and cfg.moe_latent_size is None
    torch.set_num_threads(1)
    trainer = Trainer(_run_config(to_dict(cfg), "local", 1, str(tmp_path / "run")), single_process_layout(CPU))
    init_weights_from(trainer.state, tmp_path / "ds")
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ds(tokens).logits
        _close(trainer.model.logits(tokens), ref, "DeepSeek-V3 import vs transformers")
        # the groups change routing for these weights: without them the logits differ
        for moe in trainer.model.moe_layers():
            moe.router.num_groups = 1
        assert (trainer.model.logits(tokens) - ref).abs().max() > 1e-3


def test_group_limited_routing_config_errors() -> None:
    base = {**_tiny_model(), "num_expert_groups": 3}
    with pytest.raises(ValueError, match="num_expert_groups=3 must divide num_experts=8"):
        from_dict(ModelConfig, base, "model")
    with pytest.raises(ValueError, match="topk_expert_groups=5 must be in"):
        from_dict(ModelConfig, {**_tiny_model(), "num_expert_groups": 4, "topk_expert_groups": 5}, "model")
    with pytest.raises(ValueError, match=r"model\.rope_yarn\.factor"):
        from_dict(ModelConfig, {**_tiny_model(), "rope_yarn": {"factor": 0.5, "original_max_position": 64}}, "model")


def test_deepseek_v3_fp8_import(tmp_path: Path) -> None:
    """The FP8 release format (e4m3 weights, fp32 `_scale_inv` per 16x16 block here, partial blocks at the
    edges) imports as the dequantized weights: bitwise the parameters imported from a directory holding
    fp8 * scale computed here in fp32."""
    _deepseek(tmp_path)
    weights = load_file(str(tmp_path / "ds" / "model.safetensors"))
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    quantized, dequantized = {}, {}
    for name, w in weights.items():
        if w.ndim != 2 or not name.startswith("model.layers.") or name.endswith("mlp.gate.weight"):
            quantized[name] = dequantized[name] = w
            continue
        rows, cols = -(-w.shape[0] // 16), -(-w.shape[1] // 16)
        padded = torch.zeros(rows * 16, cols * 16)
        padded[:w.shape[0], :w.shape[1]] = w.float()
        blocks = padded.view(rows, 16, cols, 16)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        full_scale = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[:w.shape[0], :w.shape[1]]
        q = (w.float() / full_scale).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        dequantized[name] = q.float() * full_scale
    for directory, tensors, quant in (("fp8", quantized, True), ("deq", dequantized, False)):
        (tmp_path / directory).mkdir()
        save_file(tensors, str(tmp_path / directory / "model.safetensors"))
        extra = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                         "activation_scheme": "dynamic"}} if quant else {}
        (tmp_path / directory / "config.json").write_text(json.dumps({**config, **extra}))
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.values())
    cfg, _ = read_hf(tmp_path / "fp8")
    states = []
    for directory in ("fp8", "deq"):
        trainer = Trainer(_run_config(to_dict(cfg), "local", 1, str(tmp_path / f"run_{directory}")),
                          single_process_layout(CPU))
        init_weights_from(trainer.state, tmp_path / directory)
        states.append({k: v for k, v in full_state(trainer).items() if "exp_avg" not in k})
    assert_bitwise(states[0], states[1], "FP8 import vs the dequantized weights")


@pytest.mark.parametrize("gate_rank", [8, None], ids=["low_rank_gates", "full_rank_gates"])
def test_kda_hybrid_export_parity_and_import(tmp_path: Path, gate_rank: int | None) -> None:
    """A KDA/MLA hybrid (KDA layers 0 and 2 of 4, MLA 1 and 3): the transformers-loaded export (recurrent
    KDA) gives moontrain's logits (chunked KDA) within fp32 rounding; the import is bitwise."""
    torch.set_num_threads(1)
    model = {**_tiny_model(), "num_layers": 4, "kda_layers_per_mla": 1, "kda_num_heads": 2, "kda_head_dim": 16,
             "kda_gate_rank": gate_rank}
    trainer = Trainer(_run_config(model, "local", 1, str(tmp_path / "run")), single_process_layout(CPU))
    train(trainer, 2)
    assert [b.is_kda for b in trainer.model.layers] == [True, False, True, False]
    ckpt = trainer.save_checkpoint()
    out = export_hf(ckpt, tmp_path / "hf", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    tokens = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(2))
    trainer.model.document_eos_id = None  # one sequence per row, as the HF model reads it
    with torch.no_grad():
        _close(hf(tokens).logits, trainer.model.logits(tokens), "KDA hybrid export vs moontrain")
    fresh = Trainer(_run_config(model, "local", 1, str(tmp_path / "fresh")), single_process_layout(CPU))
    init_weights_from(fresh.state, out)
    drop = ("exp_avg", ".step")
    assert_bitwise({k: v for k, v in full_state(fresh).items() if not any(d in k for d in drop)},
                   {k: v for k, v in full_state(trainer).items() if not any(d in k for d in drop)},
                   "KDA hybrid export -> import")
