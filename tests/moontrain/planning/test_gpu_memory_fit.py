"""The GPU-memory check of the dry run and of the launch: the per-rank estimate against the GPU's memory, and
where it does not fit, the estimate again with each setting that shrinks it (planning.preflight.SMALLER), one on
top of the other. Reference: estimate_memory of the same config with the settings applied by hand."""

from __future__ import annotations

import copy

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.model.params import count_params
from moontrain.planning.memory import estimate_memory
from moontrain.planning.preflight import gpu_memory_warning, smaller_settings
from moontrain.planning.report import dry_run_report

GiB = 2**30
H100 = ("an H100 80GB", 79.1 * GiB)


def _k3_small_one_gpu() -> RunConfig:
    """The recipe at one GPU with nothing recomputed (its own setting, auto, is tested in test_recompute.py)."""
    return from_dict(RunConfig, load_recipe("recipes/k3_small.yaml", ["parallel.ep=1",
                                                                      "train.activation_checkpointing=false"]))


def _estimate(cfg: RunConfig, **settings) -> float:
    cfg = copy.deepcopy(cfg)
    for key, value in settings.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return estimate_memory(cfg, count_params(cfg.model), 1, 2).total


def test_a_recipe_too_large_for_the_gpu_names_the_settings_that_fit() -> None:
    cfg = _k3_small_one_gpu()
    cfg.optim.state_dtype = "float32"  # the recipe's moments are bf16; with fp32 ones it needs both settings
    full = _estimate(cfg)
    bf16 = _estimate(cfg, optim__state_dtype="bfloat16")
    both = _estimate(cfg, optim__state_dtype="bfloat16", train__activation_checkpointing=True)
    assert both < H100[1] < bf16 < full, (full / GiB, bf16 / GiB, both / GiB)  # the case the check is for
    assert smaller_settings(cfg, 1, 2, H100[1]) == [
        f"with optim.state_dtype=bfloat16: {bf16 / GiB:.2f} GiB (does NOT fit)",
        f"with optim.state_dtype=bfloat16 train.activation_checkpointing=true: {both / GiB:.2f} GiB (fits)"]
    report = dry_run_report(cfg, 1, "cuda", gpu_memory=H100)
    assert "an H100 80GB has 79.10 GiB: does NOT fit)" in report
    assert f"  with optim.state_dtype=bfloat16 train.activation_checkpointing=true: {both / GiB:.2f} GiB (fits)" in report
    warning = gpu_memory_warning(cfg, 1, "this GPU (H100)", H100[1])
    assert warning is not None and warning.startswith(f"the memory estimate is {full / GiB:.1f} GiB a rank")
    assert "train.activation_checkpointing=true" in warning


def test_a_recipe_that_fits_gets_no_warning_and_no_suggestions() -> None:
    cfg = _k3_small_one_gpu()
    assert gpu_memory_warning(cfg, 1, "an H200", 139.8 * GiB) is None
    report = dry_run_report(cfg, 1, "cuda", gpu_memory=("an H200", 139.8 * GiB))
    assert "an H200 has 139.80 GiB: fits)" in report and "with optim.state_dtype" not in report


def test_settings_the_recipe_has_are_not_suggested_again() -> None:
    cfg = _k3_small_one_gpu()
    cfg.optim.state_dtype = "bfloat16"
    lines = smaller_settings(cfg, 1, 2, 1.0 * GiB)  # nothing fits 1 GiB
    assert lines == [f"with train.activation_checkpointing=true: "
                     f"{_estimate(cfg, train__activation_checkpointing=True) / GiB:.2f} GiB (does NOT fit)"]
    cfg.train.activation_checkpointing = True
    assert smaller_settings(cfg, 1, 2, 1.0 * GiB)[0].startswith("a smaller train.micro_batch_size")
