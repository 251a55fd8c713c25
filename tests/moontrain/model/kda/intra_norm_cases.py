"""Inputs, the specification's call and the bounds for moontrain.model.kda.intra_norm_kernel (the interpreted and the
GPU tests): moontrain.model.kda.intra_norm's reference in float64, the intra-chunk stage's reference then the
norms' part of the gate-and-norm backward's.

Tolerances, relative to each output's largest magnitude. On a GPU the [16, 16] x [16, K] products run in TF32:
each operand rounded to 2^-11 of itself, each product's terms within 2^-10 of theirs (the diagonal block's
factored operands too: the rounding is relative); a row's sum holds <= 64 terms of |dA| |k| E <= |dA| (unit rows,
E <= 1), whose absolute
sum stays within 4x the largest output at these sizes: 4 * 2^-10 = 3.9e-3, which bounds dg and db (fp32
outputs). dq_in and dk_in add one rounding to q's dtype, one bf16 ulp at most (2^-7 of the value: the
interpreter's conversion truncates, the GPU's rounds to nearest): 3.9e-3 + 2^-7. The interpreter computes the
products in fp32 and measures ~1e-7 on dg and db (and on dq_in, dk_in with fp32 q, k): the bounds are the GPU's.
"""

from __future__ import annotations

import torch

from moontrain.model.kda.intra_norm import kda_intra_norm_reference
from moontrain.model.kda.intra_norm_kernel import kda_intra_norm

TF32_TOL = 4 * 2 ** -10
OUT_TOL = {"dq_in": TF32_TOL + 2 ** -7, "dk_in": TF32_TOL + 2 ** -7, "db": TF32_TOL, "dg": TF32_TOL}


def with_rstd(x: dict, seed: int) -> dict:
    """The stage's inputs (moontrain.model.kda.intra.random_stage_inputs) with reciprocal norms of raw rows
    around 1 (fp32 [B, T, H])."""
    gen = torch.Generator(device=x["k"].device).manual_seed(seed)
    for name in ("q_rstd", "k_rstd"):
        x[name] = torch.rand(x["beta"].shape, generator=gen, device=x["k"].device) + 0.5
    return x


def reference(x: dict) -> tuple[torch.Tensor, ...]:
    """The specification (moontrain.model.kda.intra_norm) in float64, unrounded: (dq_in, dk_in, db, dg)."""
    wide = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for n, v in x.items()}
    return kda_intra_norm_reference(*(wide[n] for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg",
                                                        "q_rstd", "k_rstd")),
                                    lower_bound=x["lower_bound"], cu_seqlens=x["cu_seqlens"],
                                    chunk_indices=x["chunk_indices"])


def run(x: dict) -> tuple[torch.Tensor, ...]:
    return kda_intra_norm(x["q"], x["k"], x["g"], x["beta"], x["dAqk"], x["dAkk"], x["dq"], x["dk"], x["db"], x["dg"],
                          x["q_rstd"], x["k_rstd"], lower_bound=x["lower_bound"], cu_seqlens=x["cu_seqlens"],
                          chunk_indices=x["chunk_indices"])
