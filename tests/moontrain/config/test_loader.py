"""The strict recipe loader: errors name the dotted key and what is allowed; overrides; base include; dump."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moontrain.config import RunConfig, apply_overrides, dump_config, from_dict, load_recipe

REPO = Path(__file__).resolve().parents[3]


def _raw() -> dict:
    return load_recipe(REPO / "recipes" / "k3_tiny.yaml")


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_recipes_load() -> None:
    for name in ("k3_tiny", "k3_small", "k3"):
        cfg = from_dict(RunConfig, load_recipe(REPO / "recipes" / f"{name}.yaml"))
        assert cfg.model.expert_width * cfg.model.moe_intermediate_size % 2048 == 0


def test_unknown_key_names_dotted_key_and_allowed() -> None:
    raw = _raw()
    raw["model"]["num_layer"] = 4
    with pytest.raises(ValueError, match=r"unknown key\(s\) model\.num_layer \(did you mean model\.num_layers\?\); "
                                         r"allowed keys under model: .*'num_layers'"):
        from_dict(RunConfig, raw)


def test_unknown_top_level_section() -> None:
    raw = _raw()
    raw["trainer"] = {}
    with pytest.raises(ValueError, match=r"unknown key\(s\) trainer \(did you mean train\?\); allowed keys under <recipe root>"):
        from_dict(RunConfig, raw)


def test_wrong_type() -> None:
    raw = _raw()
    raw["model"]["num_layers"] = "four"
    with pytest.raises(ValueError, match=r"model\.num_layers: expected int, got 'four'"):
        from_dict(RunConfig, raw)
    raw = _raw()
    raw["model"]["num_layers"] = True  # bool is not an int here
    with pytest.raises(ValueError, match=r"model\.num_layers: expected int, got True"):
        from_dict(RunConfig, raw)
    raw = _raw()
    raw["optim"]["lr"] = 1  # int -> float is accepted
    assert from_dict(RunConfig, raw).optim.lr == 1.0


def test_missing_required() -> None:
    raw = _raw()
    del raw["model"]["hidden_size"]
    with pytest.raises(ValueError, match=r"missing required key model\.hidden_size \(int\)"):
        from_dict(RunConfig, raw)


def test_literal_lists_allowed_values() -> None:
    raw = _raw()
    raw["experts"]["backend"] = "deepep"
    with pytest.raises(ValueError, match=r"experts\.backend: 'deepep' is not one of the allowed values "
                                         r"\['local', 'alltoall', 'moonep'\]"):
        from_dict(RunConfig, raw)


def test_optional_accepts_null() -> None:
    raw = _raw()
    raw["model"]["moe_latent_size"] = None
    raw["model"]["moe_intermediate_size"] = 64  # 64 x 64 = 2 * 2048
    assert from_dict(RunConfig, raw).model.expert_width == 64


def test_expert_shape_granularity() -> None:
    raw = _raw()
    raw["model"]["moe_intermediate_size"] = 48
    with pytest.raises(ValueError, match=r"expert shape 32x48 has 1536 elements, not a multiple of 2048"):
        from_dict(RunConfig, raw)


def test_overrides_parse_yaml_then_typecheck() -> None:
    raw = apply_overrides(_raw(), ["model.num_layers=4", "optim.lr=1e-3", "model.moe_latent_size=null",
                                   "model.moe_intermediate_size=64", "experts.backend=local"])
    cfg = from_dict(RunConfig, raw)
    assert (cfg.model.num_layers, cfg.optim.lr, cfg.model.moe_latent_size) == (4, 1e-3, None)
    assert cfg.experts.backend == "local"
    with pytest.raises(ValueError, match=r"model\.num_layers: expected int, got 'x'"):
        from_dict(RunConfig, apply_overrides(_raw(), ["model.num_layers=x"]))
    with pytest.raises(ValueError, match=r"unknown key\(s\) model\.nope"):
        from_dict(RunConfig, apply_overrides(_raw(), ["model.nope=1"]))
    with pytest.raises(ValueError, match=r"override 'model\.num_layers' is not of the form dotted\.key=value"):
        apply_overrides(_raw(), ["model.num_layers"])
    with pytest.raises(ValueError, match=r"model\.num_layers is a value, not a section"):
        apply_overrides(_raw(), ["model.num_layers.x=1"])


def test_moonep_combine_reduce_override() -> None:
    cfg = from_dict(RunConfig, apply_overrides(_raw(), ["experts.moonep.combine_reduce=destination"]))
    assert cfg.experts.moonep.combine_reduce == "destination"
    assert from_dict(RunConfig, _raw()).experts.moonep.combine_reduce == "source"
    with pytest.raises(ValueError, match=r"experts\.moonep\.combine_reduce.*'source', 'destination'"):
        from_dict(RunConfig, apply_overrides(_raw(), ["experts.moonep.combine_reduce=dest"]))


def test_base_include_relative_to_recipe(tmp_path: Path) -> None:
    base = _raw()
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "base.yaml", base)
    child = _write(tmp_path / "sub" / "child.yaml", {"base": "base.yaml", "model": {"num_layers": 5}})
    cfg = from_dict(RunConfig, load_recipe(child, ["train.steps=7"]))
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.steps) == (5, base["model"]["hidden_size"], 7)


def test_input_paths_are_relative_to_the_recipe_that_names_them(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "base.yaml", {**_raw(), "eval": {"every": 5, "data": {"path": "held/out.jsonl"}},
                                    "checkpoint": {"init_from": "~/weights", "resume": "auto"}})
    child = _write(tmp_path / "sub" / "child.yaml", {
        "base": "../base.yaml", "data": {"source": "dataset", "path": "corpus/*.jsonl", "tokenizer": "tok.json",
                                         "sources": {}},
        "train": {"run_dir": "runs/x"}})
    cfg = from_dict(RunConfig, load_recipe(child))
    assert cfg.data.path == str(tmp_path / "sub" / "corpus/*.jsonl")
    assert cfg.data.tokenizer == str(tmp_path / "sub" / "tok.json")
    assert cfg.eval.data.path == str(tmp_path / "held/out.jsonl")  # the base's own folder
    assert cfg.checkpoint.init_from == str(Path("~/weights").expanduser()) and cfg.checkpoint.resume == "auto"
    assert cfg.train.run_dir == "runs/x"  # an output: the working directory's
    over = from_dict(RunConfig, load_recipe(child, ["data.path=mine.jsonl", "data.tokenizer=bytes"]))
    assert (over.data.path, over.data.tokenizer) == ("mine.jsonl", "bytes")  # command line: as given
    mixture = from_dict(RunConfig, load_recipe(_write(tmp_path / "sub" / "mix.yaml", {
        **_raw(), "data": {"source": "dataset", "sources": {"web": {"path": "web.parquet", "weight": 2.0}}}})))
    assert mixture.data.sources["web"].path == str(tmp_path / "sub" / "web.parquet")
    assert from_dict(RunConfig, _raw()).data.path == str(REPO / "recipes/data/tiny_corpus.jsonl")


def test_at_most_one_base(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", _raw())
    _write(tmp_path / "b.yaml", {"base": "a.yaml"})
    c = _write(tmp_path / "c.yaml", {"base": "b.yaml"})
    with pytest.raises(ValueError, match=r"has its own base: 'a\.yaml'; at most one base: level is allowed"):
        load_recipe(c)
    d = _write(tmp_path / "d.yaml", {"base": "missing.yaml"})
    with pytest.raises(ValueError, match=r"base: 'missing\.yaml' in .* which does not exist"):
        load_recipe(d)


def test_missing_recipe() -> None:
    with pytest.raises(ValueError, match=r"recipe 'nowhere\.yaml' does not exist"):
        load_recipe("nowhere.yaml")


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = from_dict(RunConfig, apply_overrides(_raw(), ["model.num_layers=4"]))
    dump_config(cfg, tmp_path / "run" / "config.yaml")
    again = from_dict(RunConfig, yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()))
    assert again == cfg


@pytest.mark.parametrize(("world", "overrides", "match"), [
    (3, [], r"world size 3 is not divisible by parallel\.ep=2"),
    (2, ["parallel.ep=2", "model.num_experts=6", "model.num_experts_per_tok=2"], None),
    (4, ["parallel.ep=4", "model.num_experts=6"], r"model\.num_experts=6 is not divisible by parallel\.ep=4"),
    (2, ["train.global_batch_size=3"], r"train\.global_batch_size=3 is not divisible by the world size 2"),
    (2, ["experts.backend=local"], r"experts\.backend=local .* needs parallel\.ep=1, got 2"),
    (2, ["train.global_batch_size=12", "train.micro_batch_size=4"],
     r"train\.micro_batch_size=4 does not divide the 6 sequences per rank .* use a divisor of 6"),
    (2, ["train.global_batch_size=12", "train.micro_batch_size=3"], None),
])
def test_world_checks(world: int, overrides: list[str], match: str | None) -> None:
    cfg = from_dict(RunConfig, apply_overrides(_raw(), overrides))
    if match is None:
        cfg.check_world(world)
    else:
        with pytest.raises(ValueError, match=match):
            cfg.check_world(world)
