"""fla's shipped autotune choices, copied into Triton's cache before the first KDA kernel runs.

fla autotunes each kernel of chunk_kda per call shape on first use (minutes for k3_small's shapes) and keeps
the choice on disk through Triton's `cache_results`: <cache dir>/<key>/<kernel>.autotune.json, the key a
base32 sha256 of Triton's own hash, the backend's (ptxas version, GPU architecture), the kernel's source,
the cache-invalidating environment, the call's shape key and the configuration list. The repository ships
such entries (recipes/data/fla_autotune_h200: its README says which shapes and how they were made,
made_with.json what they hash for; recipes/data/fla_autotune_h100: keys the H200's folder lacks, timed on an
H100, seeded after it, so an H200 entry for the same key would win). The worker seeds them on every rank of a
run that uses fla on CUDA, before the trainer is built; tests/conftest.py at the start of a GPU session;
launch/gpu_checks.sh through `python -m moontrain.trainer.kernel_cache`.

Where: Triton's knobs.cache.dir, read when seeding: TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache
(TRITON_HOME defaults to the home directory), the folder the ranks' Triton reads.

What is copied (docs/security.md): only <key>/<kernel>.autotune.json directly under the shipped folder, a
regular file (no symbolic link, nor one in its folder's place), <key> 52 base32 characters as Triton names
its folders, <kernel> a Python name; its bytes parse as JSON of the form Triton writes, {"key": [scalars],
"configs_timings": [[config, timings], ...]}, each config only triton.Config's fields with pre_hook and
ir_override null (a hook or an IR file to load is no tile choice) and integer tile sizes and launch
settings, each timing a number >= 0 (inf: the configuration failed) or a list of them. A refused entry is
named in a warning and skipped: it costs only autotune time. The bytes checked are the bytes written. An
entry the cache holds is left alone (the user's own search or an earlier seed): a copy is written to a
temporary file of this process and hard-linked into place, which never replaces a file another rank put
there meanwhile and is never seen half written.

When nothing applies: another Triton or fla-core version, or another GPU architecture, hashes to other
folders, so the entries would never be read; nothing is copied and FlaSeed.mismatch says why. On another
GPU of the same architecture they are read, though timed on the GPU made_with.json names.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHIPPED_FLA_DIR = REPO / "recipes" / "data" / "fla_autotune_h200"
# seeded in this order (an entry the cache holds already wins): the H200's, then keys it lacks timed on an H100
SHIPPED_FLA_DIRS = (SHIPPED_FLA_DIR, REPO / "recipes" / "data" / "fla_autotune_h100")
SUFFIX = ".autotune.json"
KEY_FOLDER = re.compile(r"[A-Z2-7]{52}")  # base32 of a sha256, unpadded (triton.runtime.cache._base32)
KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,149}")  # Triton keeps fn.__name__[:150]
CONFIG_FIELDS = frozenset({"kwargs", "num_warps", "num_ctas", "num_stages", "maxnreg", "pre_hook", "ir_override"})


@dataclass(frozen=True, slots=True)
class FlaSeed:
    """What seeding Triton's cache with the shipped fla entries did."""

    shipped: Path
    cache_dir: Path
    in_cache: int  # shipped entries now in the cache (copied now, or there before)
    copied: int
    mismatch: str | None = None  # why no shipped entry can be read here (then nothing was copied)
    timed_on: str | None = None  # the GPU the entries were timed on, when it is not this one

    def describe(self) -> str:
        if self.mismatch is not None:
            return f"nothing seeded from {shown(self.shipped)}: {self.mismatch}"
        return (f"{self.in_cache} {'entry' if self.in_cache == 1 else 'entries'} seeded from {shown(self.shipped)}"
                + (f", timed on an {self.timed_on}" if self.timed_on else ""))


@dataclass(frozen=True, slots=True)
class FlaSeeds:
    """What seeding the shipped folders (SHIPPED_FLA_DIRS, in order) did, read as one FlaSeed is."""

    seeds: tuple[FlaSeed, ...]

    @property
    def cache_dir(self) -> Path:
        return self.seeds[0].cache_dir

    @property
    def mismatch(self) -> str | None:
        """Why no shipped entry can be read here: the first folder's reason, when no folder applies."""
        return self.seeds[0].mismatch if all(seed.mismatch is not None for seed in self.seeds) else None

    def describe(self) -> str:
        applied = [seed for seed in self.seeds if seed.mismatch is None] or self.seeds[:1]
        return ", and ".join(seed.describe() for seed in applied)


def seed_shipped_fla(device: torch.device) -> FlaSeeds:
    """seed_fla_cache from each shipped folder in turn (a run's worker, the GPU tests, gpu_checks.sh)."""
    return FlaSeeds(tuple(seed_fla_cache(device, folder) for folder in SHIPPED_FLA_DIRS))


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def triton_cache_dir() -> Path:
    from triton import knobs

    return Path(knobs.cache.dir)


def autotune_entries(cache_dir: Path) -> int:
    """How many autotune results the cache holds (fla writes one per kernel and shape it searched)."""
    return sum(1 for _ in cache_dir.glob(f"*/*{SUFFIX}"))


def seed_fla_cache(device: torch.device, shipped: Path = SHIPPED_FLA_DIR) -> FlaSeed:
    """Copy the shipped entries Triton's cache lacks, when they can apply to this machine (CUDA `device`)."""
    cache_dir = triton_cache_dir()
    if not (shipped / "made_with.json").is_file():
        return FlaSeed(shipped=shipped, cache_dir=cache_dir, in_cache=0, copied=0,
                       mismatch="the folder is missing (moontrain installed without its repository)")
    made = json.loads((shipped / "made_with.json").read_text())
    here = {"triton": _version("triton"), "fla-core": _version("fla-core"),
            "capability": "{}.{}".format(*torch.cuda.get_device_capability(device))}
    mismatch = shipped_mismatch(here, made)
    if mismatch is not None:
        return FlaSeed(shipped=shipped, cache_dir=cache_dir, in_cache=0, copied=0, mismatch=mismatch)
    in_cache, copied = copy_missing(cache_dir, shipped)
    name = torch.cuda.get_device_name(device)
    return FlaSeed(shipped=shipped, cache_dir=cache_dir, in_cache=in_cache, copied=copied,
                   timed_on=made["gpu"] if name != made["gpu"] else None)


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def shipped_mismatch(here: dict[str, str], made: dict[str, str]) -> str | None:
    """Why entries made with `made` hash to folders this machine (`here`) never reads; None if they apply."""
    differ = [f"{name} {here[name]} here, they are for {made[name]}" for name in here if here[name] != made[name]]
    return "; ".join(differ) or None


def copy_missing(cache_dir: Path, shipped: Path = SHIPPED_FLA_DIR) -> tuple[int, int]:
    """Copy each sound shipped entry `cache_dir` lacks; returns (sound entries now in the cache, copied now)."""
    in_cache = copied = 0
    for src in sorted(shipped.glob(f"*/*{SUFFIX}")):
        data, problem = read_entry(src)
        if problem is not None:
            warnings.warn(f"fla autotune entry {src} not copied into Triton's cache: {problem} (fla searches "
                          "that shape's tiles instead)", stacklevel=2)
            continue
        dst = cache_dir / src.parent.name / src.name
        if not dst.exists():
            copied += _place(dst, data)
        in_cache += 1
    return in_cache, copied


def read_entry(src: Path) -> tuple[bytes, str | None]:
    """The entry's bytes and None, or what is wrong with it."""
    if src.is_symlink() or src.parent.is_symlink():
        return b"", "a symbolic link (only files of the shipped folder are copied)"
    if not KEY_FOLDER.fullmatch(src.parent.name):
        return b"", "its folder is not a Triton cache key (52 base32 characters)"
    if not KERNEL_NAME.fullmatch(src.name.removesuffix(SUFFIX)):
        return b"", f"its name is not <kernel name>{SUFFIX}"
    if not src.is_file():
        return b"", "not a regular file"
    data = src.read_bytes()
    return data, entry_problem(data)


def entry_problem(data: bytes) -> str | None:
    """What keeps `data` from being an autotune result as Triton writes it; None if it is one."""
    try:
        entry = json.loads(data)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        return f"not JSON ({err})"
    if not isinstance(entry, dict) or set(entry) != {"key", "configs_timings"}:
        return "not an object of 'key' and 'configs_timings'"
    if not isinstance(entry["key"], list) or not all(isinstance(v, str | int | float | None) for v in entry["key"]):
        return "'key' is not a list of numbers and strings"
    pairs = entry["configs_timings"]
    if not isinstance(pairs, list) or not pairs:
        return "'configs_timings' is not a non-empty list"
    for i, pair in enumerate(pairs):
        problem = _pair_problem(pair)
        if problem is not None:
            return f"configs_timings[{i}]: {problem}"
    return None


def _pair_problem(pair: object) -> str | None:
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict)):
        return "not a [config, timings] pair"
    config, timings = pair
    if "kwargs" not in config or not set(config) <= CONFIG_FIELDS:
        return f"config fields {sorted(config)}, expected kwargs and some of {sorted(CONFIG_FIELDS - {'kwargs'})}"
    kwargs = config["kwargs"]
    if not isinstance(kwargs, dict) or not all(_count(v) for v in kwargs.values()):
        return f"kwargs {kwargs!r} are not integer tile sizes"
    for name in ("num_warps", "num_ctas", "num_stages"):
        if name in config and not _count(config[name]):
            return f"{name}={config[name]!r} is not an integer"
    if config.get("maxnreg") is not None and not _count(config["maxnreg"]):
        return f"maxnreg={config['maxnreg']!r} is neither null nor an integer"
    for name in ("pre_hook", "ir_override"):
        if config.get(name) is not None:
            return f"{name}={config[name]!r}, expected null"
    values = timings if isinstance(timings, list) else [timings]
    # inf: the configuration failed to run (Triton's own entries hold such); NaN would make its choice arbitrary
    if not values or not all(isinstance(t, int | float) and not isinstance(t, bool) and t >= 0 for t in values):
        return f"timings {timings!r} are not numbers >= 0"
    return None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _place(dst: Path, data: bytes) -> bool:
    """Write `data` at `dst` unless a file is there by then; True if written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    try:
        os.link(tmp, dst)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


def main() -> None:
    """launch/gpu_checks.sh: seed the cache the way a run does, and say what was done."""
    if not torch.cuda.is_available():
        print("moontrain: no CUDA GPU: Triton's cache is not seeded")
        return
    print(f"moontrain: fla autotune: {seed_shipped_fla(torch.device('cuda', 0)).describe()}")


if __name__ == "__main__":
    main()
