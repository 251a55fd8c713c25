"""Block digests of checkpoint files (moontrain/checkpoint/digest.py): each block's sha256 equals hashlib's over
the same bytes (the reference: slices of the file hashed in the test), however the stream is cut into updates;
a changed byte in any block of a rank file is named by file and block at load; a checkpoint of format v1 (one
sha256 per file) still loads, bit for bit, and its corruption is reported the same way."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import pytest
import torch

from moontrain.checkpoint import CheckpointError, digest, store
from moontrain.checkpoint.digest import BlockSha256, file_block_sha256
from moontrain.checkpoint.safetensors_io import write_safetensors
from moontrain.parallel.layout import single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train

V1 = "moontrain-checkpoint-v1"


def _reference(data: bytes, block: int) -> list[str]:
    return [hashlib.sha256(data[lo:lo + block]).hexdigest() for lo in range(0, len(data), block)]


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 640, 1000])
@pytest.mark.parametrize("threads", [1, 3])
def test_block_digests_are_hashlibs_over_the_blocks(tmp_path: Path, size: int, threads: int) -> None:
    data = random.Random(size).randbytes(size)
    cuts = sorted(random.Random(size + 1).sample(range(size + 1), min(size + 1, 12)))
    with BlockSha256(block_bytes=64, threads=threads) as h:
        h.update(b"")
        for lo, hi in zip([0, *cuts], [*cuts, size], strict=True):
            h.update(memoryview(data)[lo:hi])
        assert h.hexdigests() == _reference(data, 64)
    (tmp_path / "f").write_bytes(data)
    assert file_block_sha256(tmp_path / "f", block_bytes=64, threads=threads) == _reference(data, 64)


def test_file_blocks_read_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "_READ_BYTES", 24)  # each 64-byte block read in 3 pieces, the last one short
    data = random.Random(7).randbytes(1000)
    (tmp_path / "f").write_bytes(data)
    assert file_block_sha256(tmp_path / "f", block_bytes=64, threads=3) == _reference(data, 64)


def test_large_updates_are_hashed_on_the_pool() -> None:
    data = random.Random(0).randbytes(3 << 20)  # over the inline limit: its 3 pieces go to the threads
    with BlockSha256(block_bytes=1 << 20, threads=4) as h:
        h.update(data[:1000])
        h.update(torch.frombuffer(bytearray(data[1000:]), dtype=torch.int32).numpy())  # cast to bytes
        assert h.hexdigests() == _reference(data, 1 << 20)


def test_streamed_file_block_digests(tmp_path: Path) -> None:
    state = {"a": torch.randn(300, 7), "b": torch.arange(1000, dtype=torch.int64), "c": torch.randn(5, 9).t()}
    with BlockSha256(block_bytes=256, threads=2) as h:
        write_safetensors(tmp_path / "f.safetensors", [(n, tuple(t.shape), t.dtype, lambda t=t: t)
                                                       for n, t in state.items()], digest=h, chunk_bytes=1000)
    assert h.hexdigests() == _reference((tmp_path / "f.safetensors").read_bytes(), 256)


@pytest.mark.parametrize(("block_bytes", "threads"), [(0, 1), (64, 0)])
def test_bad_settings_are_named(block_bytes: int, threads: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockSha256(block_bytes=block_bytes, threads=threads)


def _trainer(run_dir: Path) -> Trainer:
    torch.set_num_threads(1)
    return Trainer(small_config("local", 1, run_dir=str(run_dir)), single_process_layout(torch.device("cpu")))


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor]]:
    monkeypatch.setattr(digest, "BLOCK_BYTES", 4096)  # many blocks in the small model's file
    trainer = _trainer(tmp_path)
    train(trainer, 1)
    ckpt = trainer.save_checkpoint()
    state = full_state(trainer)
    trainer.close()
    return ckpt, state


def test_a_changed_byte_in_any_block_is_named(saved: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt, want = saved
    shard = ckpt / "rank_00000.safetensors"
    entry = json.loads((ckpt / store.MANIFEST).read_text())["files"][shard.name]
    good = shard.read_bytes()
    assert entry["block_bytes"] == 4096 and entry["bytes"] == len(good) > 3 * 4096
    assert entry["block_sha256"] == _reference(good, 4096)
    fresh = _trainer(tmp_path)
    last = (len(good) - 1) // 4096
    for k, at in [(0, 3), (1, 4096), (last // 2, last // 2 * 4096 + 100), (last, len(good) - 1)]:
        data = bytearray(good)
        data[at] ^= 0x01
        shard.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {shard} is corrupt: block {k} (bytes "
                                                            f"[{k * 4096}, {min(k * 4096 + 4096, len(good))}))")
                           + ".*load an earlier checkpoint"):
            fresh.load_checkpoint(ckpt)
    shard.write_bytes(good)
    fresh.load_checkpoint(ckpt)
    assert_bitwise(full_state(fresh), want, "after the blocks were restored")
    fresh.close()


def _as_v1(ckpt: Path) -> None:
    """Rewrite a checkpoint as the v1 code wrote it: the format string (same length, in the manifest, the train
    state and each file's safetensors metadata) and one whole-file sha256 per file."""
    manifest = json.loads((ckpt / store.MANIFEST).read_text())
    manifest["format"] = V1
    state_bytes = (ckpt / store.TRAIN_STATE).read_bytes().replace(store.FORMAT.encode(), V1.encode())
    (ckpt / store.TRAIN_STATE).write_bytes(state_bytes)
    for file in manifest["files"]:
        path = ckpt / file
        if file != store.TRAIN_STATE:
            path.write_bytes(path.read_bytes().replace(store.FORMAT.encode(), V1.encode(), 1))
        data = path.read_bytes()
        manifest["files"][file] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))


def test_a_v1_checkpoint_loads_bitwise_and_is_verified(saved: tuple[Path, dict], tmp_path: Path) -> None:
    ckpt, want = saved
    _as_v1(ckpt)
    shard = ckpt / "rank_00000.safetensors"
    assert V1.encode() in shard.read_bytes()[:shard.read_bytes().index(b"}}") + 2]
    fresh = _trainer(tmp_path)
    state = fresh.load_checkpoint(ckpt)
    assert state["step"] == 1
    assert_bitwise(full_state(fresh), want, "a v1 checkpoint")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {shard} is corrupt: its sha256 differs "
                                                        "from the manifest") + ".*load an earlier checkpoint"):
        fresh.load_checkpoint(ckpt)
    fresh.close()
