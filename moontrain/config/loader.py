"""Strict serialization between YAML recipes and the component dataclass configs.

A recipe is a YAML mapping whose keys are exactly the fields of `RunConfig` and its nested
component configs. Unknown keys, wrong types and missing required fields raise ValueError naming the
dotted key and what is allowed; nothing is silently ignored or coerced (except int -> float, which
YAML writers produce for round numbers like `lr: 1` and which loses nothing).

A recipe may name one `base:` (a path relative to the recipe file). The base is loaded first and the
recipe is deep-merged over it. A base may not itself have a base: one level keeps recipes readable.

Command-line overrides are dotted `key=value` strings (`model.num_layers=4`); the value is parsed
with yaml.safe_load (so `4` is an int, `1e-3` a float, `null` None) and then type-checked exactly
like a recipe value. One YAML 1.1 quirk is repaired: PyYAML reads `1e-3` (an exponent without a dot)
as a string; float fields accept such strings.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a recipe (plus its optional base) and apply dotted overrides; returns the raw mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {str(path)!r} does not exist; pass the path of a YAML file, e.g. recipes/k3_tiny.yaml")
    raw = _read_yaml(path)
    base = raw.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ValueError(f"base: must be a path string relative to {path}, got {base!r}")
        base_path = path.parent / base
        if not base_path.is_file():
            raise ValueError(f"base: {base!r} in {path} resolves to {base_path}, which does not exist")
        base_raw = _read_yaml(base_path)
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


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, strictly (see module docstring)."""
    where = prefix or "<recipe root>"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping with keys {_field_names(cls)}, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        keys = ", ".join(_join(prefix, k) for k in unknown)
        raise ValueError(f"unknown key(s) {keys}; allowed keys under {where}: {sorted(fields)}")
    kwargs = {}
    for name, field in fields.items():
        key = _join(prefix, name)
        if name not in data:
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if required:
                raise ValueError(f"missing required key {key} ({_type_name(hints[name])})")
            continue
        kwargs[name] = _convert(hints[name], data[name], key)
    return cls(**kwargs)


def dump_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again by from_dict)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def to_dict(config: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return to_dict(value) if dataclasses.is_dataclass(value) else value


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ValueError as err:
                errors.append(str(err))
        if len(errors) == 1:  # X | None: the one real option's own message names the nested key
            raise ValueError(errors[0])
        raise ValueError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise ValueError(f"{key}: {value!r} is not one of the allowed values {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin is dict:  # name -> value (e.g. data.sources.web); keys are names, values converted strictly
        key_type, value_type = get_args(tp)
        assert key_type is str, f"config mappings are keyed by str, {key} is not"
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping of name -> {_type_name(value_type)}, got {value!r}")
        for name in value:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{key}: keys must be non-empty names, got {name!r}")
        return {name: _convert(value_type, v, f"{key}.{name}") for name, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected bool (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value):
            value = float(value)  # PyYAML (YAML 1.1) reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected float, got {value!r}")
        if not math.isfinite(value):  # no setting means anything at nan or inf; they only surface as a NaN loss
            raise ValueError(f"{key}: expected a finite float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected str, got {value!r}")
        return value
    raise AssertionError(f"config type {tp!r} at {key} is not supported by the loader")


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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return f"one of {list(get_args(tp))}"
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
