"""Strict conversion between the dataclass configs and plain mappings (what YAML reads and writes).

from_dict builds a dataclass from a mapping whose keys are exactly its fields (nested dataclasses
recursively, and `dict[str, X]` fields as name -> X); unknown keys, wrong types and missing required
fields raise ValueError naming the dotted key and what is allowed. A key a dataclass has retired (its
class attribute RETIRED_KEYS: old name -> what to write instead) is refused with that replacement.
Nothing is coerced except int -> float (YAML writes round numbers like `lr: 1` as ints, which loses
nothing) and, for float fields, PyYAML's `1e-3` string (YAML 1.1 reads an exponent without a dot as a
string); nan and inf are refused. to_dict is its inverse. The recipe layer (files, base:, overrides) is
moontrain.config.loader; this module has no moontrain imports, so any package may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, strictly (see module docstring)."""
    where = prefix or "<recipe root>"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping with keys {_field_names(cls)}, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    retired = getattr(cls, "RETIRED_KEYS", {})
    for name in unknown:
        if name in retired:
            raise ValueError(f"{_join(prefix, name)} is no longer a config key: {retired[name]}")
    if unknown:
        keys = ", ".join(_join(prefix, k) + _did_you_mean(k, fields, prefix) for k in unknown)
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


def _did_you_mean(key: str, fields: Iterable[str], prefix: str) -> str:
    close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.75)
    return f" (did you mean {_join(prefix, close[0])}?)" if close else ""


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
