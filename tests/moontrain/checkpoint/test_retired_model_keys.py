"""Checkpoints and HF exports of older versions, whose model config still carries the keys that have left
ModelConfig (kda_kernel, router_tf32, attn_pad_head_dims: now kernels.*; router_skew: a benchmark's), load
as before: a resume restores the train state bit for bit, the launcher's resume check passes, export and
generation read the model, and an older export imports bit for bit. Reference: the state of the run that
saved the checkpoint. Each of these paths refused such a checkpoint before saved_model_dict.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moontrain.checkpoint import export_hf, init_weights_from, read_hf
from moontrain.checkpoint.manifest import TRAIN_STATE
from moontrain.config import RunConfig, from_dict
from moontrain.config.loader import to_dict
from moontrain.generate.load import load_model
from moontrain.model.config import ModelConfig
from moontrain.parallel.layout import single_process_layout
from moontrain.planning.resume_check import check_resume
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, rewrite_saved_model, small_config, train

CPU = torch.device("cpu")
# what a checkpoint of the version before the move wrote for them (values other than the defaults, so that
# a path that still read them would be seen)
OLD_KEYS = {"kda_kernel": "torch", "router_tf32": False, "attn_pad_head_dims": True, "router_skew": 0.0}


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, Path, dict[str, torch.Tensor], torch.Tensor]:
    """(config, checkpoint rewritten as an older version's, the saving run's state, its logits on fixed tokens)."""
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("older") / "run"
    cfg = small_config("local", 1, steps=4, run_dir=str(run_dir), checkpoint={"save_final": False})
    trainer = Trainer(cfg, single_process_layout(CPU))
    train(trainer, 2)
    ckpt = trainer.save_checkpoint()
    state = full_state(trainer)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    trainer.model.document_eos_id = None  # the loaded model reads each row as one sequence
    with torch.no_grad():
        logits = trainer.model.logits(tokens)
    trainer.close()
    rewrite_saved_model(ckpt, lambda model: {**model, **OLD_KEYS})
    assert set(OLD_KEYS) <= set(json.loads((ckpt / TRAIN_STATE).read_text())["model"])
    return cfg, ckpt, state, logits


def test_resume_restores_the_state(older) -> None:
    cfg, ckpt, state, _ = older
    assert check_resume(cfg).checkpoint == ckpt  # the launcher's check before any worker
    trainer = Trainer(cfg, single_process_layout(CPU))
    trainer.load_checkpoint(ckpt)
    assert trainer.step == 2
    assert_bitwise(full_state(trainer), state, "resume from an older version's checkpoint")
    trainer.close()


def test_generation_loads_the_model(older) -> None:
    cfg, ckpt, _, logits = older
    model, _ = load_model(ckpt, device=CPU, dtype=torch.float32, tokenizer="bytes")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.logits(tokens)
    assert torch.equal(got, logits), f"max |diff| {(got - logits).abs().max().item():.3g}"


def test_export_and_an_older_export_import(older, tmp_path: Path) -> None:
    cfg, ckpt, state, _ = older
    out = export_hf(ckpt, tmp_path / "hf", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert not set(OLD_KEYS) & set(config["moontrain_model"])  # a new export writes today's ModelConfig
    assert from_dict(ModelConfig, config["moontrain_model"], "moontrain_model") == cfg.model
    config["moontrain_model"] = {**config["moontrain_model"], **OLD_KEYS}  # as an older version exported it
    (out / "config.json").write_text(json.dumps(config))
    assert read_hf(out)[0] == cfg.model
    fresh = Trainer(from_dict(RunConfig, {**to_dict(cfg), "train": {**to_dict(cfg.train), "seed": 99}}),
                    single_process_layout(CPU))
    init_weights_from(fresh.state, out)
    params = {k: v for k, v in full_state(fresh).items() if "exp_avg" not in k and not k.endswith(".step")}
    assert_bitwise(params, {k: state[k] for k in params}, "import of an older version's export")
    fresh.close()
