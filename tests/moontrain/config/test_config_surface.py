"""The config surface, pinned: the dotted keys of RunConfig (every key a recipe or an override can set) are
exactly those listed in run_config_keys.txt, each is documented where it is defined (a comment on its field,
on the line or directly above, or a `name: ...` line in its dataclass's docstring), every section has its
entry in the README's config reference, and the keys that left the surface are refused with their
replacement: from a recipe file and an override alike, and in one line at the CLI.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import get_args, get_origin

import pytest
import yaml

from moontrain.cli import main
from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.model.config import KernelsConfig, ModelConfig
from moontrain.parallel.config import ParallelConfig

REPO = Path(__file__).resolve().parents[3]
PINNED = Path(__file__).with_name("run_config_keys.txt")


def _unwrap(tp: typing.Any) -> typing.Any:
    """X for `X | None`, else tp."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        real = [a for a in get_args(tp) if a is not type(None)]
        if len(real) == 1:
            return real[0]
    return tp


def config_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """(dotted key, the dataclass that defines it, its field name) for every key under `cls`, depth first;
    a `dict[str, X]` field's entries are `key.*.<X's keys>`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        yield key, cls, f.name
        tp = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from config_keys(tp, key + ".")
        elif get_origin(tp) is dict and dataclasses.is_dataclass(get_args(tp)[1]):
            yield from config_keys(get_args(tp)[1], key + ".*.")


def documented_fields(cls: type) -> set[str]:
    """Fields of `cls` with a comment on their line or on the line directly above, or a `name:` docstring line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comment_lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                     if tok.type == tokenize.COMMENT}
    out = set(re.findall(r"^([a-z_0-9]+):", inspect.getdoc(cls) or "", re.MULTILINE))
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.lineno in comment_lines or node.lineno - 1 in comment_lines:
                out.add(node.target.id)
    return out


def _pinned() -> list[str]:
    return [line for line in PINNED.read_text().splitlines() if line and not line.startswith("#")]


def test_the_keys_are_the_pinned_list() -> None:
    keys = [key for key, _, _ in config_keys(RunConfig)]
    assert len(keys) == len(set(keys))
    pinned = _pinned()
    new, gone = sorted(set(keys) - set(pinned)), sorted(set(pinned) - set(keys))
    assert not new, (f"new config key(s) {new}: document each on its field, mention it in the README's config "
                     f"reference, and add it to {PINNED.relative_to(REPO)}")
    assert not gone, (f"config key(s) {gone} are gone: remove them from {PINNED.relative_to(REPO)} and the README, "
                      "and if recipes or checkpoints may still hold one, add it to its dataclass's RETIRED_KEYS "
                      "with what to write instead")
    assert keys == pinned, f"the keys are the pinned ones in another order: keep {PINNED.name} in field order"


def test_every_key_is_documented() -> None:
    documented: dict[type, set[str]] = {}
    missing = [key for key, cls, name in config_keys(RunConfig)
               if name not in documented.setdefault(cls, documented_fields(cls))]
    assert not missing, (f"undocumented config key(s) {missing}: add a comment on the field (on its line or "
                         "directly above) or a `name: ...` line in its dataclass's docstring")


def test_the_documentation_check_sees_a_bare_field() -> None:
    @dataclasses.dataclass
    class Probe:
        """described: named here."""

        described: int = 0
        commented: int = 0  # on its line
        # above it
        above: int = 0
        bare: int = 0

    assert documented_fields(Probe) == {"described", "commented", "above"}


def test_the_readme_describes_every_section() -> None:
    readme = (REPO / "README.md").read_text()
    reference = readme[readme.index("## Config reference"):]
    reference = reference[:reference.index("\n## ", 1)]
    missing = [f.name for f in dataclasses.fields(RunConfig) if f"\n- `{f.name}`:" not in reference]
    assert not missing, f"README's config reference has no entry for section(s) {missing}"


RETIRED = [  # (override, what the error must name)
    ("parallel.fsdp=true", r"parallel\.fsdp is no longer a config key: write parallel\.dense=fsdp\|allreduce\|plain "
                           r"instead \(parallel\.fsdp=true was parallel\.dense=fsdp, the default; parallel\.fsdp=false "
                           r"was parallel\.dense=allreduce\)"),
    ("parallel.fsdp=false",
     r"parallel\.fsdp is no longer a config key: .*parallel\.fsdp=false was parallel\.dense=allreduce"),
    ("model.kda_kernel=torch",
     r"model\.kda_kernel is no longer a config key: write kernels\.kda=auto\|torch\|fla instead"),
    ("model.router_tf32=false", r"model\.router_tf32 is no longer a config key: write kernels\.router_gemm"),
    ("kernels.router_tf32=false", r"kernels\.router_tf32 is no longer a config key: write kernels\.router_gemm=split_bf16"),
    ("model.attn_pad_head_dims=true",
     r"model\.attn_pad_head_dims is no longer a config key: write kernels\.attn_pad_head_dims instead"),
    ("model.router_skew=0.5",
     r"model\.router_skew is no longer a config key: .*Router\.set_skew\); drop it from the recipe"),
]


def test_the_retired_keys_are_the_listed_ones() -> None:
    retired = {f"{section}.{name}" for section, cls in (("parallel", ParallelConfig), ("model", ModelConfig),
                                                        ("kernels", KernelsConfig))
               for name in cls.RETIRED_KEYS}
    assert retired == {override.split("=")[0] for override, _ in RETIRED}
    assert not retired & set(_pinned())  # a retired key is not a key


@pytest.mark.parametrize(("override", "message"), RETIRED, ids=[o for o, _ in RETIRED])
def test_a_retired_key_names_its_replacement(override: str, message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=message):
        from_dict(RunConfig, load_recipe(REPO / "recipes" / "k3_tiny.yaml", [override]))
    key, value = override.split("=")
    section, name = key.split(".")
    old = yaml.safe_load((REPO / "recipes" / "k3_tiny.yaml").read_text())  # an old recipe file holding the key
    old.setdefault(section, {})[name] = yaml.safe_load(value)
    recipe = tmp_path / "old.yaml"
    recipe.write_text(yaml.safe_dump(old))
    with pytest.raises(ValueError, match=message):
        from_dict(RunConfig, load_recipe(recipe))
    assert main(["launch", str(recipe), "--dry-run", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"moontrain: error: " + message, err), err


@pytest.mark.parametrize(("override", "message"), [
    ("kernels.kda_dqkg=triton", r"kernels\.kda_dqkg: 'triton' is not one of the allowed values \['fla', 'moontrain'\]"),
    ("kernels.short_conv=cuda", r"kernels\.short_conv: 'cuda' is not one of the allowed values \['auto', 'torch', 'triton'\]"),
])
def test_a_kernel_choice_outside_its_values_is_named(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_dict(RunConfig, load_recipe(REPO / "recipes" / "k3_tiny.yaml", [override]))
    key = override.split("=")[0].split(".")[1]
    with pytest.raises(ValueError, match=rf"kernels\.{key} must be .*, got '{override.split('=')[1]}'"):
        KernelsConfig(**{key: override.split("=")[1]})


def test_the_walking_convolution_backward_refuses_more_taps_before_the_run() -> None:
    """kernels.short_conv_backward=walk (the default) holds at most 4 taps in registers: a longer convolution is
    refused when the config is built, naming both fixes; the tile route takes it."""
    recipe = REPO / "recipes" / "k3_tiny.yaml"
    assert KernelsConfig().short_conv_backward == "walk"
    assert from_dict(RunConfig, load_recipe(recipe, ["model.kda_conv_size=4"])).model.kda_conv_size == 4
    with pytest.raises(ValueError, match=r"short_conv_backward=walk takes at most 4 taps, model\.kda_conv_size=5; "
                                         r"set kernels\.short_conv_backward=tiles .* or a smaller kda_conv_size"):
        from_dict(RunConfig, load_recipe(recipe, ["model.kda_conv_size=5"]))
    cfg = from_dict(RunConfig, load_recipe(recipe, ["model.kda_conv_size=5", "kernels.short_conv_backward=tiles"]))
    assert cfg.model.kda_conv_size == 5
