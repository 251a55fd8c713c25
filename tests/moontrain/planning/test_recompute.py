"""train.activation_checkpointing as true, false, a number of layers or "auto": which layers, the activation
estimate with them, and auto's choice against a GPU's memory. References: the k3_small recipe's layer types (12
KDA, 4 MLA, a dense first layer), the activation model's own per-layer rows summed by hand, and estimate_memory
at the layers named explicitly."""

from __future__ import annotations

import itertools
import re

import pytest

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.model.params import count_params
from moontrain.planning.activations import (
    activation_bytes,
    configured_recompute,
    layer_activations,
    recompute_order,
)
from moontrain.planning.memory import AUTO_SHARE, estimate_memory, fit_recompute, planned_recompute
from moontrain.planning.preflight import gpu_memory_warning, smaller_settings
from moontrain.planning.report import dry_run_report

GiB = 2**30


def _k3_small(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, load_recipe("recipes/k3_small.yaml", ["parallel.ep=1", *overrides]))


@pytest.mark.parametrize(("value", "want"), [("true", True), ("false", False), ("auto", "auto"), ("6", 6), ("0", 0)])
def test_setting_parses(value: str, want: object) -> None:
    assert _k3_small(f"train.activation_checkpointing={value}").train.activation_checkpointing == want


@pytest.mark.parametrize(("value", "message"), [
    ("17", "train.activation_checkpointing=17 layers, the model has model.num_layers=16; use at most 16"),
    ("-1", "train.activation_checkpointing must be true, false, auto or a number of layers >= 0, got -1"),
    ("1.5", "train.activation_checkpointing: expected bool or int or one of ['auto'], got 1.5"),
    ("most", "expected bool or int or one of ['auto'], got 'most'"),
])
def test_bad_setting_names_the_value_and_the_fix(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _k3_small(f"train.activation_checkpointing={value}")


def test_the_kda_layers_go_first() -> None:
    """The layers that keep the most go first: k3_small's KDA+MoE layers (151 KB a token), then its first layer
    (KDA with the dense FFN, 125 KB), then the MLA+MoE layers (119 KB); n layers are the first n of that order."""
    cfg = _k3_small()
    kda = [i for i in range(16) if cfg.model.layer_is_kda(i) and i >= cfg.model.num_dense_layers]
    mla = [i for i in range(16) if not cfg.model.layer_is_kda(i)]
    order = recompute_order(cfg, 2)
    assert (len(kda), len(mla)) == (11, 4)
    assert sorted(order[:11]) == kda and order[11] == 0 and sorted(order[12:]) == mla
    kept = [layer.total for layer in layer_activations(cfg, 2)]
    assert [kept[i] for i in order] == sorted(kept, reverse=True)
    assert configured_recompute(_k3_small("train.activation_checkpointing=5"), 2) == tuple(sorted(order[:5]))
    assert configured_recompute(_k3_small("train.activation_checkpointing=true"), 2) == tuple(range(16))
    assert configured_recompute(_k3_small("train.activation_checkpointing=false"), 2) == ()
    assert configured_recompute(_k3_small("train.activation_checkpointing=auto"), 2) is None


def test_activation_peak_is_the_forward_end_or_a_layers_backward() -> None:
    """The forward's end holds every kept layer, the recomputed layers' inputs (D a token) and the head's bytes; a
    layer's backward its own activations whole beside the kept layers before it and the recomputed inputs up to
    it; outside the layers, the final aggregation (N values x 8 bytes) and the head input's grad."""
    cfg = _k3_small()
    D, c, S = cfg.model.hidden_size, 2, 100
    full = [layer.total for layer in layer_activations(cfg, c)]
    outside = 8 * 4 + D * c  # the final aggregation: 3 completed blocks (layers 0, 6, 12 start one) and the partial sum
    assert activation_bytes(cfg, c, (), S, 7.0) == S * (sum(full) + outside) + 7.0  # the forward's end
    # only the last layer recomputed, no head bytes: its backward (its activations again) is the peak
    assert activation_bytes(cfg, c, (15,), S, 0.0) == S * (sum(full) + D * c + outside)
    # with the head's bytes above one layer's, the forward's end is
    big = S * full[15]
    assert activation_bytes(cfg, c, (15,), S, big) == S * (sum(full[:15]) + D * c + outside) + big
    # every layer recomputed, no head bytes: the layer whose activations and inputs up to it are the most
    want = max(full[i] + (i + 1) * D * c for i in range(16))
    assert activation_bytes(cfg, c, tuple(range(16)), S, 0.0) == S * (want + outside)
    # bytes of the backward alone (a pass's dense grads) add to the backward's moments, not to the forward's end
    assert activation_bytes(cfg, c, tuple(range(16)), S, 0.0, backward=5.0) == S * (want + outside) + 5.0
    assert activation_bytes(cfg, c, (), S, 7.0, backward=5.0) == S * (sum(full) + outside) + 7.0


def test_auto_takes_the_fewest_layers_that_fit() -> None:
    cfg = _k3_small("train.activation_checkpointing=auto")
    counts, order = count_params(cfg.model), recompute_order(_k3_small(), 2)
    totals = [estimate_memory(cfg, counts, 1, 2, tuple(order[:n])).total for n in range(17)]
    assert totals[0] == estimate_memory(_k3_small(), counts, 1, 2).total  # auto unresolved: nothing recomputed
    assert totals[16] == estimate_memory(_k3_small("train.activation_checkpointing=true"), counts, 1, 2).total
    assert all(b < a for a, b in itertools.pairwise(totals[2:]))  # more layers, less memory (from 2 on)
    assert fit_recompute(cfg, counts, 1, 2, totals[0]) == ()
    assert fit_recompute(cfg, counts, 1, 2, totals[9]) == tuple(sorted(order[:9]))
    assert fit_recompute(cfg, counts, 1, 2, totals[9] - 1) == tuple(sorted(order[:10]))
    assert fit_recompute(cfg, counts, 1, 2, 1.0) == tuple(range(16))  # nothing fits: every layer (and a warning)
    assert planned_recompute(cfg, counts, 1, 2, None) == ()  # a CPU run
    assert planned_recompute(cfg, counts, 1, 2, totals[9] / AUTO_SHARE) == tuple(sorted(order[:9]))
    assert planned_recompute(cfg, counts, 1, 2, 141e9) == ()  # an H200: the recipe's pass fits whole


def test_auto_in_the_dry_run_and_the_launch_warning() -> None:
    """On an 80 GB H100 auto recomputes part of the model and the launch has nothing to warn about; on a 40 GB
    GPU every layer is recomputed, which still does not fit: the warning says so."""
    cfg = _k3_small("train.activation_checkpointing=auto")
    counts = count_params(cfg.model)
    h100 = 79.1 * GiB
    layers = planned_recompute(cfg, counts, 1, 2, h100)
    assert 0 < len(layers) < 16
    report = dry_run_report(cfg, 1, "cuda", gpu_memory=("an H100", h100))
    named = ", ".join(map(str, layers))
    assert (f"(activations: train.activation_checkpointing=auto: {len(layers)} of 16 layers recomputed ({named}); "
            "an H100 has 79.10 GiB: fits)") in report
    assert gpu_memory_warning(cfg, 1, "an H100", h100) is None
    warning = gpu_memory_warning(cfg, 1, "a 40 GB GPU", 40 * GiB)
    need = estimate_memory(cfg, counts, 1, 2, tuple(range(16))).total
    assert warning is not None and warning.startswith(f"the memory estimate is {need / GiB:.1f} GiB a rank")


def test_the_suggestions_resolve_auto_and_do_not_repeat_it() -> None:
    """Where auto cannot fit (fp32 moments on a 70 GiB GPU), the suggestions are estimated with auto resolved as
    at launch (not as if nothing were recomputed), and recomputing every layer is not suggested on top of auto;
    a recipe that recomputes one layer (1, not true) still gets that suggestion."""
    cfg = _k3_small("train.activation_checkpointing=auto", "optim.state_dtype=float32")
    counts, have = count_params(cfg.model), 70 * GiB
    trial = _k3_small("train.activation_checkpointing=auto", "optim.state_dtype=bfloat16")
    want = estimate_memory(trial, counts, 1, 2, planned_recompute(trial, counts, 1, 2, have)).total
    assert want < estimate_memory(trial, counts, 1, 2).total  # auto recomputes some layers there
    fits = "fits" if want <= have else "does NOT fit"
    assert smaller_settings(cfg, 1, 2, have) == [f"with optim.state_dtype=bfloat16: {want / GiB:.2f} GiB ({fits})"]
    one = _k3_small("train.activation_checkpointing=1")
    assert smaller_settings(one, 1, 2, 1.0 * GiB) == [
        f"with train.activation_checkpointing=true: "
        f"{estimate_memory(_k3_small('train.activation_checkpointing=true'), counts, 1, 2).total / GiB:.2f} GiB "
        "(does NOT fit)"]
