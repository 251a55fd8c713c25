"""Seeding Triton's cache with fla's shipped autotune entries (moontrain.trainer.kernel_cache), on the CPU:

- every shipped entry passes the check and is copied byte for byte where the cache lacks it; an entry the
  cache holds stays as it is; a second seeding copies nothing and no temporary file is left;
- an entry that is malformed (not JSON, another shape, a pre_hook or ir_override, a NaN timing) or
  that leaves the shipped folder or its layout (a symbolic link to a file or folder outside, a folder that
  is not a cache key, a kernel name with other characters) is named in a warning and not copied;
- the cache is the folder Triton resolves (TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache);
- entries made with another Triton, fla-core or GPU architecture are reported as not applying;
- the H100's folder holds only keys the H200's lacks, and both folders seed in order, said in one line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from moontrain.trainer.kernel_cache import (
    SHIPPED_FLA_DIR,
    SHIPPED_FLA_DIRS,
    copy_missing,
    read_entry,
    seed_fla_cache,
    seed_shipped_fla,
    shipped_mismatch,
    triton_cache_dir,
)

KEY = "A" * 52  # the shape of a Triton cache folder's name


def _cache_files(cache_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(cache_dir).as_posix(): p.read_bytes() for p in cache_dir.rglob("*") if p.is_file()}


def test_seed_copies_missing_entries_and_leaves_existing_ones(tmp_path: Path) -> None:
    entries = sorted(SHIPPED_FLA_DIR.glob("*/*.autotune.json"))
    assert len(entries) >= 40, entries  # fla's chunk_kda kernels, rows and documents (docs/kda.md)
    cache = tmp_path / "cache"
    kept = cache / entries[0].parent.name / entries[0].name
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")  # the user's own file: never overwritten
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every shipped entry passes the check
        assert copy_missing(cache, SHIPPED_FLA_DIR) == (len(entries), len(entries) - 1)
    expected = {f"{src.parent.name}/{src.name}": src.read_bytes() for src in entries[1:]}
    expected[f"{kept.parent.name}/{kept.name}"] = b"{}"
    assert _cache_files(cache) == expected
    assert copy_missing(cache, SHIPPED_FLA_DIR) == (len(entries), 0)
    assert _cache_files(cache) == expected


def _mutated(good: dict, timings: object = None, **changes: object) -> bytes:
    """`good`'s first configuration with `changes` (and `timings`, if given), as the only one."""
    config, good_timings = good["configs_timings"][0]
    pair = [dict(config, **changes), good_timings if timings is None else timings]
    return json.dumps({"key": good["key"], "configs_timings": [pair]}).encode()


def test_malformed_and_escaping_entries_are_refused_and_named(tmp_path: Path) -> None:
    source = sorted(SHIPPED_FLA_DIR.glob("*/*.autotune.json"))[0]
    good_bytes = source.read_bytes()
    good = json.loads(good_bytes)
    shipped, outside, cache = tmp_path / "shipped", tmp_path / "outside", tmp_path / "cache"
    (outside / KEY).mkdir(parents=True)
    (outside / "secret.autotune.json").write_bytes(good_bytes)  # valid JSON: only the path check refuses it
    (outside / KEY / "k.autotune.json").write_bytes(good_bytes)
    bad = {  # relative path -> what the warning says
        f"{KEY}/not_json.autotune.json": (b"{'key': 1", "not JSON"),
        f"{KEY}/shape.autotune.json": (json.dumps({"key": [1], "timings": []}).encode(), "not an object of"),
        f"{KEY}/hook.autotune.json": (_mutated(good, pre_hook="os.system"), "pre_hook='os.system', expected null"),
        f"{KEY}/ir.autotune.json": (_mutated(good, ir_override="/etc/passwd"), "ir_override='/etc/passwd'"),
        f"{KEY}/tile.autotune.json": (_mutated(good, kwargs={"BT": "64"}), "not integer tile sizes"),
        f"{KEY}/field.autotune.json": (_mutated(good, launcher="x"), "config fields"),
        f"{KEY}/nan.autotune.json": (_mutated(good, timings=[float("nan"), 0.1]), "not numbers >= 0"),
        f"{KEY}/link.autotune.json": (outside / "secret.autotune.json", "a symbolic link"),
        f"{'B' * 52}/k.autotune.json": (outside / KEY, "a symbolic link"),  # the folder is the link
        "not_a_key/k.autotune.json": (good_bytes, "not a Triton cache key"),
        f"{KEY}/a-b.autotune.json": (good_bytes, "<kernel name>.autotune.json"),
    }
    (shipped / KEY).mkdir(parents=True)
    (shipped / "not_a_key").mkdir()
    (shipped / KEY / "good.autotune.json").write_bytes(good_bytes)
    for rel, (content, _) in bad.items():
        path = shipped / rel
        if isinstance(content, Path):
            (path.parent if content.is_dir() else path).symlink_to(content)
        else:
            path.write_bytes(content)
    with pytest.warns(UserWarning) as caught:
        assert copy_missing(cache, shipped) == (1, 1)
    messages = {str(w.message).split(" not copied")[0].removeprefix("fla autotune entry "): str(w.message)
                for w in caught}
    assert sorted(messages) == sorted(str(shipped / rel) for rel in bad)
    for rel, (_, reason) in bad.items():
        assert reason in messages[str(shipped / rel)], (rel, messages[str(shipped / rel)])
    assert _cache_files(cache) == {f"{KEY}/good.autotune.json": good_bytes}


def test_cache_dir_is_the_one_triton_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert triton_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert triton_cache_dir() == tmp_path / ".triton" / "cache"


def test_entries_of_another_triton_or_gpu_are_reported_as_not_applying() -> None:
    made = json.loads((SHIPPED_FLA_DIR / "made_with.json").read_text())
    assert made == {"triton": "3.6.0", "fla-core": "0.6.0", "capability": "9.0", "gpu": "NVIDIA H200"}
    here = {"triton": "3.6.0", "fla-core": "0.6.0", "capability": "9.0"}
    assert shipped_mismatch(here, made) is None
    assert shipped_mismatch({**here, "triton": "3.5.0", "capability": "10.0"}, made) == (
        "triton 3.5.0 here, they are for 3.6.0; capability 10.0 here, they are for 9.0")


def test_a_missing_shipped_folder_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    seed = seed_fla_cache(torch.device("cpu"), shipped=tmp_path / "absent")  # no device query before the check
    assert (seed.cache_dir, seed.in_cache, seed.copied) == (tmp_path / "cache", 0, 0)
    assert seed.describe() == (f"nothing seeded from {tmp_path / 'absent'}: the folder is missing (moontrain "
                               "installed without its repository)")


def test_the_h100_folder_holds_sound_entries_for_keys_the_h200_folder_lacks() -> None:
    h200, h100 = SHIPPED_FLA_DIRS
    made = json.loads((h100 / "made_with.json").read_text())
    assert made == {"triton": "3.6.0", "fla-core": "0.6.0", "capability": "9.0", "gpu": "NVIDIA H100 80GB HBM3"}
    names = {folder: {p.relative_to(folder).as_posix() for p in folder.glob("*/*.autotune.json")}
             for folder in SHIPPED_FLA_DIRS}
    assert names[h100] and not names[h100] & names[h200]  # seeded second, so an H200 entry would win anyway
    for name in names[h100]:
        assert read_entry(h100 / name)[1] is None, name


def test_the_shipped_folders_seed_in_order_and_are_described_together(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from moontrain.trainer import kernel_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_cache, "_version", {"triton": "3.6.0", "fla-core": "0.6.0"}.get)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    seeds = seed_shipped_fla(torch.device("cuda"))
    counts = [len(list(folder.glob("*/*.autotune.json"))) for folder in SHIPPED_FLA_DIRS]
    assert [(s.in_cache, s.copied) for s in seeds.seeds] == [(n, n) for n in counts]
    assert len(_cache_files(tmp_path / "cache")) == sum(counts)
    assert seeds.mismatch is None and seeds.cache_dir == tmp_path / "cache"
    assert seeds.describe() == (f"{counts[0]} entries seeded from recipes/data/fla_autotune_h200, and "
                                f"{counts[1]} {'entry' if counts[1] == 1 else 'entries'} seeded from "
                                "recipes/data/fla_autotune_h100, timed on an NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(kernel_cache, "_version", {"triton": "3.5.0", "fla-core": "0.6.0"}.get)
    foreign = seed_shipped_fla(torch.device("cuda"))
    assert foreign.mismatch == "triton 3.5.0 here, they are for 3.6.0"
    assert foreign.describe() == ("nothing seeded from recipes/data/fla_autotune_h200: triton 3.5.0 here, they are "
                                  "for 3.6.0")
