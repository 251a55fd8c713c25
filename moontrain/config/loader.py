"""Strict serialization between YAML recipes and the component dataclass configs.

A recipe is a YAML mapping whose keys are exactly the fields of `RunConfig` and its nested
component configs. Unknown keys, wrong types and missing required fields raise ValueError naming the
dotted key and what is allowed; nothing is silently ignored or coerced (except int -> float, which
YAML writers produce for round numbers like `lr: 1` and which loses nothing).

A recipe may name one `base:` (a path relative to the recipe file). The base is loaded first and the
recipe is deep-merged over it. A base may not itself have a base: one level keeps recipes readable.

Input files a recipe names (INPUT_PATHS: data, tokenizer, evaluation data, initial weights, a checkpoint
to resume) are relative to the file that names them, and are made absolute when it is read, so a recipe
works from any working directory and the resolved config.yaml reads the same files from anywhere. Output
locations (train.run_dir, checkpoint.dir) and command-line values stay relative to the working directory.

Command-line overrides are dotted `key=value` strings (`model.num_layers=4`); the value is parsed
with yaml.safe_load (so `4` is an int, `1e-3` a float, `null` None) and then type-checked exactly
like a recipe value. One YAML 1.1 quirk is repaired: PyYAML reads `1e-3` (an exponent without a dot)
as a string; float fields accept such strings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from moontrain.dataclass_dict import from_dict, to_dict

__all__ = ["apply_overrides", "dump_config", "from_dict", "load_recipe", "to_dict"]


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a recipe (plus its optional base) and apply dotted overrides; returns the raw mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {str(path)!r} does not exist; pass the path of a YAML file, e.g. recipes/k3_tiny.yaml")
    raw = _read_yaml(path)
    base = raw.pop("base", None)
    _resolve_inputs(raw, path.parent)
    if base is not None:
        if not isinstance(base, str):
            raise ValueError(f"base: must be a path string relative to {path}, got {base!r}")
        base_path = path.parent / base
        if not base_path.is_file():
            raise ValueError(f"base: {base!r} in {path} resolves to {base_path}, which does not exist")
        base_raw = _read_yaml(base_path)
        _resolve_inputs(base_raw, base_path.parent)
        if "base" in base_raw:
            raise ValueError(
                f"base recipe {base_path} has its own base: {base_raw['base']!r}; at most one base: level "
                "is allowed, merge the two bases into one file"
            )
        raw = _deep_merge(base_raw, raw)
    return apply_overrides(raw, overrides)


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of `raw` with each `dotted.key=value` override set (value parsed as YAML)."""
    raw = _deep_merge({}, raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} is not of the form dotted.key=value, e.g. model.num_layers=4")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as err:
            raise ValueError(f"override {item!r}: the value is not valid YAML: {_yaml_problem(err)}; quote "
                             "strings that contain ':', '{' or '['") from None
        node = raw
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"override {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a section; "
                    f"it cannot hold {parts[depth + 1]!r}"
                )
            node = child
        node[parts[-1]] = value
    return raw


def dump_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again by from_dict)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


# (section, ..., key) of the input files a recipe may name; "*" is any name of a mapping (data.sources.NAME)
INPUT_PATHS = (("data", "path"), ("data", "tokenizer"), ("data", "sources", "*", "path"), ("eval", "data", "path"),
               ("checkpoint", "init_from"), ("checkpoint", "resume"))
_NOT_PATHS = ("bytes", "auto", "none")  # data.tokenizer=bytes, checkpoint.resume=auto / none


def _resolve_inputs(raw: dict[str, Any], folder: Path) -> None:
    """Make the relative input paths of one recipe file absolute against its folder, in place."""
    def visit(node: Any, keys: tuple[str, ...]) -> None:
        if not isinstance(node, dict) or not keys:
            return
        head, rest = keys[0], keys[1:]
        for name in (list(node) if head == "*" else [head] if head in node else []):
            if rest:
                visit(node[name], rest)
            elif isinstance(node[name], str) and node[name] and node[name] not in _NOT_PATHS:
                node[name] = os.path.abspath(folder / Path(node[name]).expanduser())

    for keys in INPUT_PATHS:
        visit(raw, keys)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        with path.open() as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {_yaml_problem(err)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"recipe {path} must be a YAML mapping at the top level, got {type(raw).__name__}")
    return raw


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error as one line: what is wrong and where (1-based line and column)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + (f"{problem} ({context})" if context else problem)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = {k: (_deep_merge({}, v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = _deep_merge({}, v) if isinstance(v, dict) else v
    return out
