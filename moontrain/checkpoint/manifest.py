"""The checkpoint manifest: what a checkpoint holds, checked whole before anything in it is used.

manifest.json, written last by rank 0 (store.py):

    {"format": FORMAT, "step": int, "finite": bool, "max_abs": float | null,
     "files": {name: {"bytes": int, "block_bytes": int, "block_sha256": [hex, ...]}   a rank file (digest.py)
             | {name: {"bytes": int, "sha256": hex}},                                  train_state.json
     "tensors": {name: {"shape": [int, ...], "pieces": [[file, offset, rows], ...]}},
     "manifest_sha256": hex}

`manifest_sha256` is the sha256 of the other keys as canonical JSON (sorted keys, no spaces), so one
changed digit anywhere in the manifest is found before it is used. It detects damage and careless edits,
not a deliberate rewrite (whoever can write a checkpoint could recompute it); against that, every read is
also bounded by the rank file's own safetensors header (tensors.py). Formats v1 and v2 have no digest and
are still read, with the same schema and header checks.

`read_manifest` refuses, with one CheckpointError naming the file and what is wrong: invalid JSON, an
unknown format, a wrong digest, a missing or mistyped key, a file name that is not a plain name inside the
checkpoint directory (`../x`, `/etc/hostname`, `a/b`), a listing without train_state.json or without a
rank file, a block list that does not match the file size, and a piece outside its tensor's rows or in a
file that is not listed. store.is_complete treats any of these as "not a checkpoint", so `resume: auto`
and pruning pass over it like a save that did not finish.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from moontrain.checkpoint.tensors import RESTORE, CheckpointError

FORMAT = "moontrain-checkpoint-v3"  # v3: the manifest's own digest; v2: block digests (digest.py); v1: one sha256
READABLE_FORMATS = ("moontrain-checkpoint-v1", "moontrain-checkpoint-v2", FORMAT)
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
DIGEST_KEY = "manifest_sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def plain_name(name: object) -> bool:
    """Whether `name` names a file directly inside its directory: no separator, no `..`, not absolute."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest file's bytes: `manifest` with its digest added."""
    return json.dumps({**manifest, DIGEST_KEY: _digest(manifest)}).encode()


def _digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest at `path` (see the module docstring); raises CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path.parent} is not a complete checkpoint: {path} is missing (a save that did not "
                              "finish?)")
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {err}") from err
    if not isinstance(manifest, dict):
        raise _invalid(path, f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"checkpoint file {path} has format {manifest.get('format')!r}, expected one of "
                              f"{READABLE_FORMATS}")
    if manifest["format"] == FORMAT and manifest.get(DIGEST_KEY) != _digest(manifest):
        raise CheckpointError(f"checkpoint file {path} is corrupt: its content differs from its {DIGEST_KEY} "
                              f"(an edited or damaged manifest); {RESTORE}")
    problem = _schema_problem(manifest)
    if problem is not None:
        raise _invalid(path, problem)
    return manifest


def _invalid(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is not a valid manifest: {problem}; {RESTORE}")


def _is_int(value: object, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _schema_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with a parsed manifest, or None."""
    if not _is_int(manifest.get("step")):
        return f"step is {manifest.get('step')!r}, not an integer >= 0"
    if not isinstance(manifest.get("finite", True), bool):
        return f"finite is {manifest['finite']!r}, not true or false"
    max_abs = manifest.get("max_abs")
    if max_abs is not None and (type(max_abs) not in (int, float) or not 0 <= max_abs < float("inf")):
        return f"max_abs is {max_abs!r}, not a finite number >= 0 or null"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"files is {type(files).__name__}, not an object of file entries"
    for name, entry in files.items():
        problem = _file_problem(name, entry, sha256_only=name == TRAIN_STATE)
        if problem is not None:
            return problem
    if TRAIN_STATE not in files or len(files) < 2:
        return f"files lists {sorted(files)}: it needs {TRAIN_STATE} and at least one rank file"
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        return f"tensors is {type(tensors).__name__}, not an object of tensor entries"
    for name, entry in tensors.items():
        problem = _tensor_problem(name, entry, files)
        if problem is not None:
            return problem
    return None


def _file_problem(name: str, entry: object, *, sha256_only: bool) -> str | None:
    if not plain_name(name):
        return f"file name {name!r} is not a plain file name inside the checkpoint directory"
    if not isinstance(entry, dict) or not _is_int(entry.get("bytes")):
        return f"file {name!r}: {entry!r} has no integer 'bytes' >= 0"
    if "block_sha256" in entry and not sha256_only:
        blocks, block_bytes = entry["block_sha256"], entry.get("block_bytes")
        if not _is_int(block_bytes, 1) or not isinstance(blocks, list) \
                or not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in blocks):
            return f"file {name!r}: block_bytes / block_sha256 are not an integer >= 1 and a list of sha256 hex digests"
        if len(blocks) != -(-entry["bytes"] // block_bytes):
            return f"file {name!r}: {len(blocks)} block digests for {entry['bytes']} bytes in blocks of {block_bytes}"
        return None
    if not isinstance(entry.get("sha256"), str) or not _HEX64.fullmatch(entry["sha256"]):
        return f"file {name!r}: no sha256 hex digest"
    return None


def _tensor_problem(name: str, entry: object, files: dict[str, Any]) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) \
            or not all(_is_int(n) for n in entry["shape"]) or not isinstance(entry.get("pieces"), list):
        return f"tensor {name!r}: {str(entry)[:200]} is not {{'shape': [int, ...], 'pieces': [...]}}"
    rows = entry["shape"][0] if entry["shape"] else 0
    for piece in entry["pieces"]:
        if not (isinstance(piece, list) and len(piece) == 3 and _is_int(piece[1]) and _is_int(piece[2])):
            return f"tensor {name!r}: piece {piece!r} is not [file, offset, rows]"
        file, offset, count = piece
        if not isinstance(file, str) or file not in files or file == TRAIN_STATE:
            return f"tensor {name!r}: piece {piece!r} names a file that the manifest does not list as a rank file"
        if offset + count > rows:
            return f"tensor {name!r}: piece {piece!r} ends past the tensor's {rows} rows"
    return None
