"""Checkpoints of versions before model.router_mean_free_updates and model.router_bias_update existed were
trained with plain router updates and DeepSeek-V3's sign update (docs/learning.md). Such a checkpoint is read
as trained that way (ModelConfig.ADDED_KEYS): under today's defaults (mean-free, proportional) the launcher's
resume check and the trainer both refuse it, naming the two keys; with the old settings written out it
resumes bit for bit. Reference: the state of the run that saved it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moontrain.checkpoint.store import CheckpointError
from moontrain.model.config import ModelConfig
from moontrain.parallel.layout import single_process_layout
from moontrain.planning.resume_check import check_resume
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, rewrite_saved_model, small_config, train

CPU = torch.device("cpu")
OLD = {"router_mean_free_updates": False, "router_bias_update": "sign"}


def test_an_older_checkpoint_resumes_only_under_its_own_balancing(tmp_path: Path) -> None:
    assert set(OLD) == set(ModelConfig.ADDED_KEYS) and OLD == ModelConfig.ADDED_KEYS
    torch.set_num_threads(1)
    old_cfg = small_config("local", 1, steps=4, run_dir=str(tmp_path / "run"), checkpoint={"save_final": False})
    old_cfg = dataclasses.replace(old_cfg, model=dataclasses.replace(old_cfg.model, **OLD))
    trainer = Trainer(old_cfg, single_process_layout(CPU))
    train(trainer, 2)
    ckpt = trainer.save_checkpoint()
    state = full_state(trainer)
    trainer.close()
    rewrite_saved_model(ckpt, lambda model: {k: v for k, v in model.items() if k not in OLD})

    today = small_config("local", 1, steps=4, run_dir=str(tmp_path / "run"), checkpoint={"save_final": False})
    assert (today.model.router_mean_free_updates, today.model.router_bias_update) == (True, "proportional")
    with pytest.raises(ValueError, match=r"model\.router_bias_update 'sign' -> 'proportional', "
                                         r"model\.router_mean_free_updates False -> True"):
        check_resume(today)
    trainer = Trainer(today, single_process_layout(CPU))
    with pytest.raises(CheckpointError, match=r"model\.router_bias_update \(saved 'sign', now 'proportional'\)"):
        trainer.load_checkpoint(ckpt)
    trainer.close()

    assert check_resume(old_cfg).checkpoint == ckpt
    trainer = Trainer(old_cfg, single_process_layout(CPU))
    trainer.load_checkpoint(ckpt)
    assert trainer.step == 2
    assert_bitwise(full_state(trainer), state, "resume of a checkpoint without the added keys")
    trainer.close()
