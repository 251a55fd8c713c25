"""Checkpoints: exact resume at EP=2 across processes (the packed-documents data position included), resharding 2 -> 1 -> 2 (model and Adam state bitwise),
a save killed part-way, missing and corrupt files named in the error, keep_last, and the HF export round trip.

References: a run without interruption (exact resume must be bitwise identical: same ops, same inputs);
the state gathered to canonical shape at save time (a reshard must reproduce it bit for bit); the
single-process state (the HF export must equal it bit for bit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

from moontrain.checkpoint import CheckpointError, export_hf, find_latest, import_hf, read_hf
from moontrain.checkpoint.store import list_checkpoints
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.worker import resolve_resume
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")
CORPUS = {"source": "dataset", "path": str(Path(__file__).resolve().parents[3] / "recipes/data/tiny_corpus.jsonl")}


def _single(run_dir: Path, **kw) -> Trainer:
    torch.set_num_threads(1)
    return Trainer(small_config("local", 1, run_dir=str(run_dir), **kw), single_process_layout(CPU))


# ------------------------------------------------------------------------------------------ exact resume
def _straight_then_save(rank: int, world: int, run_dir: str, k3_block: bool) -> tuple[list[float], dict, list[float]]:
    cfg = small_config("moonep", 2, run_dir=run_dir, data=CORPUS, k3_block=k3_block)
    straight = Trainer(cfg, build_layout(2, CPU))
    losses = train(straight, 6)
    state = full_state(straight)
    straight.close()
    first = Trainer(cfg, build_layout(2, CPU))
    first_losses = train(first, 3)
    first.wandb_run_id = "run-abc123"
    first.save_checkpoint()
    first.close()
    return losses, state, first_losses


def _resume_and_finish(rank: int, world: int, run_dir: str, k3_block: bool) -> tuple[list[float], dict, str | None]:
    cfg = small_config("moonep", 2, run_dir=run_dir, data=CORPUS, checkpoint={"resume": "auto"}, k3_block=k3_block)
    trainer = Trainer(cfg, build_layout(2, CPU))
    trainer.load_checkpoint(resolve_resume(cfg, trainer.checkpoint_dir, trainer.layout)[0])
    assert trainer.step == 3 and trainer.tokens_seen == 3 * 4 * 16
    losses = train(trainer, 3)
    state = full_state(trainer)
    trainer.close()
    return losses, state, trainer.wandb_run_id


@pytest.mark.slow
@pytest.mark.parametrize("k3_block", [False, True], ids=["standard", "situ_attnres"])
def test_exact_resume_ep2_new_process(tmp_path: Path, k3_block: bool) -> None:
    """With the K3 block too (SiTU-GLU experts on moonep, AttnRes queries and key norms in the state)."""
    straight_losses, straight_state, first_losses = run_ranks(_straight_then_save, 2, str(tmp_path), k3_block)[0]
    rest_losses, state, run_id = run_ranks(_resume_and_finish, 2, str(tmp_path), k3_block)[0]
    assert first_losses + rest_losses == straight_losses, (first_losses, rest_losses, straight_losses)
    assert_bitwise(state, straight_state, "6 steps vs 3 + resume + 3")
    assert run_id == "run-abc123"


def _forward_then_resume(rank: int, world: int, run_dir: str) -> tuple[list[float], dict]:
    """Resume with the FSDP blocks kept gathered (parallel.fsdp_reshard_after_forward=false) after a
    forward without backward, which leaves them gathered: the load must not leave a stale copy."""
    cfg = small_config("moonep", 2, run_dir=run_dir, data=CORPUS, checkpoint={"resume": "auto"})
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, fsdp_reshard_after_forward=False))
    trainer = Trainer(cfg, build_layout(2, CPU))
    tokens, targets = trainer.data.batch(0)
    with torch.no_grad():  # counts tokens and router inputs, which the load forgets (not part of the run)
        trainer.model(tokens, targets)
    trainer.load_checkpoint(resolve_resume(cfg, trainer.checkpoint_dir, trainer.layout)[0])
    losses = train(trainer, 3)
    state = full_state(trainer)
    trainer.close()
    return losses, state


def test_resume_after_a_forward_with_gathered_blocks(tmp_path: Path) -> None:
    straight_losses, straight_state, _ = run_ranks(_straight_then_save, 2, str(tmp_path), False)[0]
    losses, state = run_ranks(_forward_then_resume, 2, str(tmp_path))[0]
    assert losses == straight_losses[3:], (losses, straight_losses)
    assert_bitwise(state, straight_state, "3 + forward + resume + 3 (blocks kept gathered) vs 6")


# ------------------------------------------------------------------------------------------ resharding
def _train_ep2_and_save(rank: int, world: int, run_dir: str) -> tuple[dict, list[float]]:
    trainer = Trainer(small_config("moonep", 2, run_dir=run_dir), build_layout(2, CPU))
    train(trainer, 3)
    trainer.save_checkpoint()
    state = full_state(trainer)
    losses = train(trainer, 2)
    trainer.close()
    return state, losses


def _load_ep2(rank: int, world: int, ckpt: str) -> tuple[dict, list[float]]:
    trainer = Trainer(small_config("alltoall", 2, run_dir=str(Path(ckpt).parent)), build_layout(2, CPU))
    trainer.load_checkpoint(ckpt)
    state = full_state(trainer)
    losses = train(trainer, 1)
    return state, losses


def test_reshard_ep2_to_1_to_ep2(tmp_path: Path) -> None:
    """Saved at world 2 (FSDP shards, EP=2 expert rows), loaded in one process (plain tensors, all experts),
    saved there and loaded at EP=2 again: model, router biases and Adam moments bitwise equal each time;
    training continues with the losses of the uninterrupted EP=2 run (fp32 reorder tolerance)."""
    saved, ep2_losses = run_ranks(_train_ep2_and_save, 2, str(tmp_path / "a"))[0]
    single = _single(tmp_path / "b")
    single.load_checkpoint(find_latest(tmp_path / "a" / "checkpoints"))
    assert_bitwise(full_state(single), saved, "EP=2 -> 1 process")
    losses = train(single, 2)
    assert losses == pytest.approx(ep2_losses, rel=1e-5), (losses, ep2_losses)
    ckpt = single.save_checkpoint()
    state_1 = full_state(single)
    state_2, more = run_ranks(_load_ep2, 2, str(ckpt))[0]
    assert_bitwise(state_2, state_1, "1 process -> EP=2")
    assert torch.isfinite(torch.tensor(more)).all()

    # the HF export (fp32) of the world-2 checkpoint holds the canonical state bit for bit, and imports anywhere
    out = export_hf(find_latest(tmp_path / "a" / "checkpoints"), tmp_path / "hf", dtype="float32")
    cfg, source = read_hf(out)
    assert cfg == single.cfg.model
    for name, value in saved.items():
        if name.startswith("router_bias") or name.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq", "step"):
            continue
        assert torch.equal(source.rows(name, 0, value.shape[0]), value), name
    fresh = _single(tmp_path / "c")
    import_hf(fresh.state, out)
    params = full_state(fresh)  # parameters and router biases (no optimizer state in an export)
    assert_bitwise(params, {k: saved[k] for k in params}, "HF export -> import")
    assert any(k.startswith("router_bias") for k in params) and not any(k.endswith("exp_avg") for k in params)


def _train_dp2xep2_and_save(rank: int, world: int, run_dir: str) -> dict:
    trainer = Trainer(small_config("alltoall", 2, run_dir=run_dir), build_layout(2, CPU))
    train(trainer, 2)
    trainer.save_checkpoint()
    return full_state(trainer)


def test_reshard_dp2xep2_to_1(tmp_path: Path) -> None:
    """World 4 = 2 replicas x EP 2: experts are written once (by the first replica), dense shards by all 4."""
    saved = run_ranks(_train_dp2xep2_and_save, 4, str(tmp_path))[0]
    ckpt = find_latest(tmp_path / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["tensors"]["model.layers.1.ffn.experts.master.gate_up"]["pieces"] == [
        ["rank_00000.safetensors", 0, 4], ["rank_00001.safetensors", 4, 4]]
    assert len(manifest["tensors"]["model.embed.weight"]["pieces"]) == 4
    single = _single(tmp_path / "b")
    single.load_checkpoint(ckpt)
    assert_bitwise(full_state(single), saved, "dp2 x EP2 -> 1 process")


# ------------------------------------------------------------------------------------------ failures
def _save_then_die_mid_save(rank: int, world: int, run_dir: str, when: str) -> None:
    import moontrain.checkpoint.store as store

    trainer = Trainer(small_config("alltoall", 1, run_dir=run_dir), build_layout(1, CPU))
    train(trainer, 2)
    trainer.save_checkpoint()
    train(trainer, 1)
    write, stream = store._write_durable, store.write_safetensors

    def die_before_manifest(path: Path, data: bytes) -> None:
        if path.name == store.MANIFEST:
            os._exit(9)  # killed: the shard files of step 3 are written, its manifest and rename never happen
        write(path, data)

    def die_mid_file(path: Path, entries: list, *args, **kw) -> int:
        def read_then_die(i: int, read):
            def inner():
                if i == len(entries) // 2:
                    os._exit(9)  # killed with half of the rank file streamed
                return read()
            return inner
        return stream(path, [(n, s, d, read_then_die(i, r)) for i, (n, s, d, r) in enumerate(entries)], *args, **kw)

    if when == "before_manifest":
        store._write_durable = die_before_manifest
    else:
        store.write_safetensors = die_mid_file
    trainer.save_checkpoint()


@pytest.mark.parametrize("when", ["before_manifest", "mid_file"])
def test_killed_save_keeps_previous_checkpoint(tmp_path: Path, when: str) -> None:
    with pytest.raises(AssertionError, match="exited with code 9"):
        run_ranks(_save_then_die_mid_save, 1, str(tmp_path), when)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003.tmp"]
    shard = root / "step_00000003.tmp" / "rank_00000.safetensors"
    assert shard.is_file()
    if when == "mid_file":  # cut short: step 2's file has the same tensors
        assert shard.stat().st_size < (root / "step_00000002" / "rank_00000.safetensors").stat().st_size
    cfg = small_config("local", 1, run_dir=str(tmp_path), checkpoint={"resume": "auto"})
    assert resolve_resume(cfg, root) == (root / "step_00000002", [])
    trainer = _single(tmp_path)
    trainer.load_checkpoint(resolve_resume(cfg, root)[0])
    assert trainer.step == 2
    train(trainer, 1)
    trainer.save_checkpoint()  # the next save removes the debris of the killed one
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]


def test_missing_and_corrupt_files_are_named(tmp_path: Path) -> None:
    trainer = _single(tmp_path)
    train(trainer, 1)
    ckpt = trainer.save_checkpoint()
    shard, manifest, state = ckpt / "rank_00000.safetensors", ckpt / "manifest.json", ckpt / "train_state.json"
    fresh = _single(tmp_path)

    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {shard} is corrupt")):
        fresh.load_checkpoint(ckpt)
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {shard} is corrupt: 100 bytes")):
        fresh.load_checkpoint(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {shard} is missing")):
        fresh.load_checkpoint(ckpt)
    assert find_latest(tmp_path / "checkpoints") is None  # an incomplete checkpoint is not a resume candidate

    state.write_text(state.read_text().replace('"step": 1', '"step": 7'))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {state} is corrupt")):
        fresh.load_checkpoint(ckpt)
    state.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {state} is missing")):
        fresh.load_checkpoint(ckpt)
    manifest.write_text(manifest.read_text()[:50])
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {manifest} is corrupt")):
        fresh.load_checkpoint(ckpt)
    manifest.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{manifest} is missing")):
        fresh.load_checkpoint(ckpt)


def test_keep_last_and_model_mismatch(tmp_path: Path) -> None:
    trainer = _single(tmp_path, checkpoint={"keep_last": 2, "every": 1, "save_final": True})
    trainer.fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_00000005", "step_00000006"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000006"]
    manifest = json.loads((root / "step_00000006" / "manifest.json").read_text())
    experts = manifest["tensors"]["model.layers.1.ffn.experts.master.gate_up"]
    assert experts["shape"] == [8, 32, 2 * 64] and experts["pieces"] == [["rank_00000.safetensors", 0, 8]]

    cfg = small_config("local", 1, run_dir=str(tmp_path))
    cfg.model = dataclasses.replace(cfg.model, num_experts=16)
    other = Trainer(cfg, single_process_layout(CPU))
    with pytest.raises(CheckpointError, match=r"model.num_experts \(saved 8, now 16\)"):
        other.load_checkpoint(root / "step_00000006")
    documents = _single(tmp_path, data=CORPUS)
    with pytest.raises(CheckpointError, match=re.escape("saved with data.source=markov, the run has data.source=dataset")):
        documents.load_checkpoint(root / "step_00000006")
