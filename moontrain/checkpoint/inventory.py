"""`moontrain checkpoints RUN_DIR`: a run's checkpoints, one line each: step, size, whether every tensor was
finite when saved, tokens seen, and whether every file matches its manifest digests (TensorSource.verify:
size and block sha256, read in full; --quick skips it). Directories that are not complete checkpoints (a
save that did not finish, `.tmp`) are listed as such; `discarded-*` folders (checkpoint.resume=none) are
named at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

from moontrain.checkpoint.store import MANIFEST, TRAIN_STATE, is_complete, open_checkpoint
from moontrain.checkpoint.tensors import CheckpointError


def checkpoints_root(path: Path) -> Path:
    """A run directory's checkpoints folder, or `path` itself when it is one."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and any(p.name.startswith("step_") for p in path.iterdir()):
        return path
    raise ValueError(f"{path} is neither a run directory with a checkpoints/ folder nor a checkpoints folder; "
                     "pass train.run_dir (e.g. runs/k3_tiny) or checkpoint.dir")


def inventory(root: Path, *, verify: bool = True) -> tuple[list[str], bool]:
    """(the table's lines, whether every complete checkpoint verified)."""
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")),
                  key=lambda p: (int(p.name[5:].removesuffix(".tmp")) if p.name[5:].removesuffix(".tmp").isdigit()
                                 else -1, p.name))
    lines = [f"{root}:", f"  {'step':>10}  {'size':>10}  {'finite':>6}  {'tokens seen':>14}  digests"]
    all_ok = True
    for path in dirs:
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        if not is_complete(path):
            why = "a save that did not finish" if path.name.endswith(".tmp") else "files missing or cut short"
            lines.append(f"  {path.name[5:]:>10}  {_size(size):>10}  {'-':>6}  {'-':>14}  incomplete ({why})")
            continue
        manifest = json.loads((path / MANIFEST).read_text())
        state: dict = {}
        try:
            state, source = open_checkpoint(path)  # train_state.json against its sha256
            if verify:
                for file in manifest["files"]:
                    if file != TRAIN_STATE:
                        source.verify(file)
            digests = "ok" if verify else "not checked (--quick)"
        except CheckpointError as err:
            digests, all_ok = f"BAD: {err}", False
        finite = "yes" if manifest.get("finite", True) else "NO"
        tokens = f"{state['tokens_seen']:,}" if "tokens_seen" in state else "-"
        lines.append(f"  {manifest['step']:>10}  {_size(size):>10}  {finite:>6}  {tokens:>14}  {digests}")
    if len(lines) == 2:
        lines.append("  (no checkpoints)")
    discarded = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("discarded-"))
    if discarded:
        lines.append(f"  set aside by checkpoint.resume=none: {', '.join(discarded)}")
    return lines, all_ok


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
