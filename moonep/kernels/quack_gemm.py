"""The expert GEMMs through quack's grouped (variable-length) CuTe DSL GEMMs: BufferOptions.expert_gemm="quack".

quack (quack-kernels, Tri Dao's CuTe DSL kernels; the `gpu` extra pins it) runs a GEMM over row groups given
by cumulative offsets: varlen M for the forward and the input gradient (y[rows of g] = x[rows of g] @ w[g]),
varlen K for the weight gradient, which it adds into the fp32 grads in its epilogue (out = alpha A B + out), so
the bf16 [G, I, O] temporary of torch._grouped_mm's wgrad and the pass that adds it (moonep.kernels.experts.
accumulate_groups) go away. The specification stays torch._grouped_mm (moonep.grouped_gemm): the forward and
the input gradient are the same products, fp32 sums rounded once to bf16 (bitwise equal to torch's at the
benchmark's shapes on one H200, which nothing guarantees for other shapes or versions); the weight gradient
skips the bf16 rounding of each pass's product (closer to the fp32 product than the torch route).
tests/moonep/datapath/test_triton_path_gpu.py holds both to the bounds of the torch route.

Offsets: moonep's offs are the cumulative ends of each group (torch._grouped_mm's format); quack takes them with
a leading zero. Rows past offs[-1] are padding no caller reads; quack leaves them unwritten.

Tiles: one config per GEMM kind (TILES): pp128x192, the faster of the two tiles benchmarks/bench_expert_gemm.py
--quack measured on one H200 for every kind but k3_small's input gradient (docs/performance.md); quack's
autotuner is not used (it compiles ~40 configs in the first step).

Needs sm90 and quack-kernels with its nvidia-cutlass-dsl; `unavailable()` says what is missing, and the Buffer
refuses the option with that reason.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch


@functools.cache
def unavailable(device_index: int) -> str | None:
    """None when quack's GEMMs can run on this CUDA device, else why not (for the Buffer's error)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major != 9:
        return f"quack's grouped GEMMs are built here for sm90 (Hopper); this GPU is sm{major}{minor}"
    try:
        import quack.gemm_interface  # noqa: F401
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        return (f"quack-kernels does not import ({type(e).__name__}: {e}); install the gpu extra "
                "(pip install -e '.[gpu]')")
    return None


# GEMM kind -> tile config name (gemm_config): "rows" for the forward and input-gradient GEMMs (varlen M),
# "wgrad" for the weight gradient (varlen K)
TILES = {"rows": "pp128x192", "wgrad": "pp128x192"}


@functools.cache
def gemm_config(name: str) -> Any:
    """quack's GemmConfig for a tile name: "pp" (ping-pong: two consumer warpgroups on alternate tiles) or
    "co" (cooperative: both on one tile), then tile M x N, e.g. "pp128x192", "co256x128"; an optional
    "-c12" for a 1 x 2 cluster (default 2 x 1)."""
    m = re.fullmatch(r"(pp|co)(\d+)x(\d+)(-c(\d)(\d))?", name)
    if not m:
        raise ValueError(f"quack tile name {name!r}: expected (pp|co)<M>x<N>[-c<cluster M><cluster N>], "
                         "e.g. pp128x192 or co256x128-c12")
    cluster = (int(m[5]), int(m[6])) if m[4] else (2, 1)
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=int(m[2]), tile_n=int(m[3]), pingpong=m[1] == "pp", cluster_m=cluster[0],
                      cluster_n=cluster[1], is_dynamic_persistent=False)


def _with_zero(offs_G: torch.Tensor) -> torch.Tensor:
    """quack's cu_seqlens: moonep's cumulative ends with a leading zero (int32)."""
    return torch.cat([offs_G.new_zeros(1), offs_G]).to(torch.int32)


def grouped_mm(x_rows: torch.Tensor, w_GIO: torch.Tensor, offs_G: torch.Tensor, tile: str | None = None
               ) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w[g] -> [rows, O] in x's dtype (w may be a transposed view); tile: a
    gemm_config name instead of TILES["rows"]."""
    from quack.gemm_interface import gemm_tuned

    y = torch.empty(x_rows.shape[0], w_GIO.shape[-1], dtype=x_rows.dtype, device=x_rows.device)
    gemm_tuned.fn(x_rows, w_GIO, y, cu_seqlens_m=_with_zero(offs_G), config=gemm_config(tile or TILES["rows"]))
    return y


def accumulate_wgrad(g_GIO: torch.Tensor, x_rows: torch.Tensor, grad_rows: torch.Tensor, offs_G: torch.Tensor,
                     scale: float, write_groups: int, tile: str | None = None) -> None:
    """g[grp] (fp32) += scale * x[rows of grp]^T grad[rows of grp] in the GEMM's epilogue; the first
    `write_groups` groups hold stale values (a grad declared zero without clearing it) and are cleared first.
    tile: a gemm_config name instead of TILES["wgrad"]."""
    from quack.gemm_interface import gemm_tuned

    if write_groups:
        g_GIO[:write_groups].zero_()
    gemm_tuned.fn(x_rows.t(), grad_rows, g_GIO, alpha=float(scale), cu_seqlens_k=_with_zero(offs_G),
                  add_to_output=True, config=gemm_config(tile or TILES["wgrad"]))
