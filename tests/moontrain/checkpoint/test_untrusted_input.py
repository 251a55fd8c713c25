"""Checkpoints and HF directories as untrusted input: nothing is loaded wrong, nothing outside is opened.

- a changed digit in a manifest is found (its digest), and a manifest rewritten with a fresh digest still
  cannot make a read reach past a tensor (every piece is checked against the rank file's own header);
- malformed manifests are one CheckpointError each, not a traceback, and `resume: auto` and pruning pass
  over them like an interrupted save;
- file names in a manifest or an HF weight_map stay inside their directory;
- a newest checkpoint with a corrupt rank file is passed over by every rank alike, and named;
- a finite but blown-up checkpoint is not the one pruning keeps as the run's sound one.

References: the saved state (bitwise), and the files a refused input names (never opened).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moontrain.checkpoint import CheckpointError, export_hf, read_hf
from moontrain.checkpoint.manifest import MANIFEST, manifest_bytes
from moontrain.checkpoint.safetensors_io import SafetensorsReader
from moontrain.checkpoint.store import is_complete, list_checkpoints, open_checkpoint, prune
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.worker import resolve_resume
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

CPU = torch.device("cpu")


def _single(run_dir: Path, **kw) -> Trainer:
    torch.set_num_threads(1)
    return Trainer(small_config("local", 1, run_dir=str(run_dir), **kw), single_process_layout(CPU))


def _rewrite(ckpt: Path, edit) -> None:
    """Apply `edit` to the parsed manifest and write it back with a fresh, valid digest."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest.pop("manifest_sha256")
    (ckpt / MANIFEST).write_bytes(manifest_bytes(edit(manifest) or manifest))


# ------------------------------------------------------------------------------- one job at world 2
def _save_twice_corrupt_and_resume(rank: int, world: int, run_dir: str) -> tuple[dict, str | None, list[str], int]:
    """Save steps 1 and 2 at world 2, flip a byte of the step-2 file only rank 1 reads at this layout (its size
    unchanged), then resolve `resume: auto` and load on both ranks."""
    cfg = small_config("alltoall", 2, run_dir=run_dir, checkpoint={"resume": "auto"})
    trainer = Trainer(cfg, build_layout(2, CPU))
    train(trainer, 1)
    trainer.save_checkpoint()
    state = full_state(trainer)
    train(trainer, 1)
    newest = trainer.save_checkpoint()
    if rank == 0:
        shard = newest / "rank_00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    fresh = Trainer(cfg, build_layout(2, CPU))
    chosen, notes = resolve_resume(cfg, fresh.checkpoint_dir, fresh.layout)
    fresh.load_checkpoint(chosen, verified=True)
    step = fresh.step
    trainer.close()
    fresh.close()
    return state, chosen.name if chosen else None, notes, step


@pytest.fixture(scope="module")
def world_2_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    run_dir = tmp_path_factory.mktemp("world2")
    return run_dir, run_ranks(_save_twice_corrupt_and_resume, 2, str(run_dir))


def test_corrupt_newest_checkpoint_falls_back_on_every_rank(world_2_job: tuple[Path, list]) -> None:
    """Before, `auto` chose step 2 by its sizes, rank 0 printed the resume and rank 1 failed on its file."""
    run_dir, out = world_2_job
    bad = run_dir / "checkpoints" / "step_00000002" / "rank_00001.safetensors"
    for _, chosen, notes, step in out:
        assert (chosen, step) == ("step_00000001", 1)
        assert len(notes) == 1 and notes[0].startswith(f"resume: auto passed over {bad.parent}: checkpoint file {bad} "
                                                       "is corrupt: block 0"), notes


# ------------------------------------------------------------------------------- a changed digit
def test_manifest_tamper_is_detected(world_2_job: tuple[Path, list], tmp_path: Path) -> None:
    """The embedding is two FSDP pieces of 130 rows; rank 0's piece said 131 rows: before, the load read row 130
    from past the tensor in rank 0's file (the next tensor's bytes), silently."""
    run_dir, out = world_2_job
    ckpt = tmp_path / "step_00000001"
    shutil.copytree(run_dir / "checkpoints" / "step_00000001", ckpt)
    saved = out[0][0]
    manifest = (ckpt / MANIFEST).read_text()
    piece = '["rank_00000.safetensors", 0, 130]'
    assert json.loads(manifest)["tensors"]["model.embed.weight"]["pieces"] == [json.loads(piece),
                                                                                ["rank_00001.safetensors", 130, 130]]
    fresh = _single(tmp_path / "fresh")
    (ckpt / MANIFEST).write_text(manifest.replace(piece, piece.replace("130", "131")))
    with pytest.raises(CheckpointError, match=r"manifest.json is corrupt: its content differs from its manifest_sha256"):
        fresh.load_checkpoint(ckpt)
    assert not is_complete(ckpt)

    _rewrite(ckpt, lambda m: None)  # the same edit, with a digest that matches it
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors does not match the manifest: its header has "
                                              r"'model.embed.weight' as \[130, 64\], the manifest's piece "
                                              r"\['rank_00000.safetensors', 0, 131\] of shape \[260, 64\] needs \[131, 64\]"):
        fresh.load_checkpoint(ckpt)
    reader = SafetensorsReader(ckpt / "rank_00000.safetensors")
    with pytest.raises(ValueError, match=r"rows \[0, 131\) of 'model.embed.weight' were asked for, it has 130"):
        reader.rows("model.embed.weight", 0, 131)
    reader.close()

    (ckpt / MANIFEST).write_text(manifest)
    fresh.load_checkpoint(ckpt)
    assert_bitwise(full_state(fresh), saved, "the untouched manifest")
    fresh.close()


# ------------------------------------------------------------------------------- malformed manifests
def _two_checkpoints(tmp_path: Path) -> tuple[Trainer, Path, Path]:
    trainer = _single(tmp_path, checkpoint={"keep_last": 2, "resume": "auto"})
    train(trainer, 1)
    good = trainer.save_checkpoint()
    train(trainer, 1)
    return trainer, good, trainer.save_checkpoint()


def _set_files(value):
    def edit(m: dict) -> None:
        m["files"] = value
    return edit


def _drop_bytes(m: dict) -> None:
    del m["files"]["rank_00000.safetensors"]["bytes"]


def _rename_rank_file(name: str):
    def edit(m: dict) -> None:
        m["files"][name] = m["files"].pop("rank_00000.safetensors")
        for entry in m["tensors"].values():
            entry["pieces"] = [[name, o, r] for _, o, r in entry["pieces"]]
    return edit


@pytest.mark.parametrize("edit, problem", [
    ("[]", "a JSON list, not an object"),
    (_set_files([]), "files is list, not an object of file entries"),
    (_drop_bytes, "file 'rank_00000.safetensors': .* has no integer 'bytes' >= 0"),
    (_set_files({}), r"files lists \[\]: it needs train_state.json and at least one rank file"),
    (_rename_rank_file("../outside.safetensors"), "file name '../outside.safetensors' is not a plain file name"),
    (_rename_rank_file("/etc/hostname"), "file name '/etc/hostname' is not a plain file name"),
], ids=["list", "files_list", "no_bytes", "no_files", "parent_dir", "absolute"])
def test_malformed_manifest_is_one_error_and_skipped(tmp_path: Path, edit, problem: str) -> None:
    trainer, good, bad = _two_checkpoints(tmp_path)
    if edit == "[]":
        (bad / MANIFEST).write_text("[]")
    else:
        _rewrite(bad, edit)
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {bad / MANIFEST} is not a valid manifest: {problem}"):
        open_checkpoint(bad)
    assert not is_complete(bad) and list_checkpoints(tmp_path / "checkpoints") == [good]
    assert resolve_resume(trainer.cfg, trainer.checkpoint_dir) == (good, [])
    prune(tmp_path / "checkpoints", keep_last=1)  # the listing a save prunes with: no crash, the good one stays
    assert list_checkpoints(tmp_path / "checkpoints") == [good]
    trainer.close()


# ------------------------------------------------------------------------------- names outside the directory
def test_weight_map_traversal_is_refused(tmp_path: Path) -> None:
    trainer = _single(tmp_path / "run")
    out = export_hf(trainer.save_checkpoint(), tmp_path / "hf", dtype="float32")
    trainer.close()
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(260, 64)}, outside / "x.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for target in ("../outside/x.safetensors", str(outside / "x.safetensors"), "/etc/hostname"):
        index["weight_map"]["model.embed_tokens.weight"] = target
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=r"weight_map names 1 shard.* that are not plain file names inside") \
                as info:
            read_hf(out)
        assert "bytes" not in str(info.value)  # nothing about the outside file (its size) leaks into the message


def test_manifest_file_names_cannot_leave_the_checkpoint(tmp_path: Path) -> None:
    """A manifest (with a valid digest) that names ../<the previous checkpoint>/rank_00000.safetensors: before, the
    load read the other directory's file."""
    trainer, good, bad = _two_checkpoints(tmp_path)
    _rewrite(bad, _rename_rank_file(f"../{good.name}/rank_00000.safetensors"))
    with pytest.raises(CheckpointError, match=r"is not a plain file name inside the checkpoint directory"):
        trainer.load_checkpoint(bad)
    trainer.close()


# ------------------------------------------------------------------------------- finite is not sound
def test_blown_up_checkpoint_is_not_the_one_kept(tmp_path: Path) -> None:
    """A huge learning rate leaves finite weights of 1e4: before, pruning kept those as the newest finite
    checkpoint and deleted the last sane one."""
    trainer = _single(tmp_path, checkpoint={"keep_last": 1})
    train(trainer, 1)
    sane = trainer.save_checkpoint()
    saved = load_file(str(sane / "rank_00000.safetensors"))
    want = max(t.abs().max().item() for n, t in saved.items() if n.startswith("model.") and t.is_floating_point())
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1e4)
    trainer.step += 1
    trainer.save_checkpoint()
    trainer.step += 1
    blown = trainer.save_checkpoint()
    manifests = [json.loads((p / MANIFEST).read_text()) for p in (sane, blown)]
    assert [m["finite"] for m in manifests] == [True, True]
    assert manifests[0]["max_abs"] == want and manifests[1]["max_abs"] >= 1e3 * want, manifests
    assert list_checkpoints(tmp_path / "checkpoints") == [sane, blown]
    trainer.close()
