"""bench_comm's --shapes presets and their per-rank memory on the CPU (the run itself needs 2 GPUs)."""

from __future__ import annotations

import argparse

from benchmarks.bench_comm import SHAPES, main, rank_bytes, resolve_shapes

H200_BYTES = 141 * 10**9  # 139.8 GiB usable


def _args(shapes: str, **given: object) -> argparse.Namespace:
    unset = {"experts": None, "topk": None, "hidden": None, "ffn": None, "pools": None}
    return resolve_shapes(argparse.Namespace(shapes=shapes, tokens=8192, **{**unset, **given}))


def test_presets_and_overrides() -> None:
    k3 = _args("k3")
    assert (k3.experts, k3.topk, k3.hidden, k3.ffn, k3.pools) == ([896], 16, 7168, 3072, False)
    latent = _args("k3", hidden=3584, pools=True)  # explicit flags win over the preset
    assert (latent.experts, latent.topk, latent.hidden, latent.ffn, latent.pools) == ([896], 16, 3584, 3072, True)
    base = _args("default")
    assert (base.experts, base.topk, base.hidden, base.ffn, base.pools) == ([96, 384], 8, 7168, 2048, True)
    assert set(SHAPES) == {"default", "k3"}


def test_k3_point_fits_a_rank_without_pools() -> None:
    """At R = 2 the K3 point's Buffer fits an H200 and its ExpertPools do not (why the preset turns
    them off); the default points fit with theirs."""
    k3 = rank_bytes(_args("k3"), 896, 2)
    nvs = 8192 * 16 + 2 * 448 * 15  # receive rows: s*K plus the padding of 2*epn groups (token_padding 16)
    assert k3["buffer"] >= 2 * nvs * 7168 * 2 + 8192 * 16 * 7168 * 2  # recv + comb + land regions, bf16
    assert k3["buffer"] < 0.1 * H200_BYTES < H200_BYTES < k3["pools"]
    assert k3["pools"] == 896 * (7168 * 6144 + 3072 * 7168) * 6  # (epn + B) = E experts of bf16 + fp32
    for E in (96, 384):
        b = rank_bytes(_args("default"), E, 2)
        assert b["buffer"] + b["pools"] < 0.8 * H200_BYTES, (E, b)


def test_dry_run_parses_and_prints(capsys) -> None:
    main(["--shapes", "k3", "--maxvio", "0", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert "E=896 K=16 H=7168 F=3072 s=8192 R=2: maxvio [0.0, 1.0]" in out
    assert "ExpertPools 330.8 GiB (off)" in out
