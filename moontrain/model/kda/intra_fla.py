"""KDA's intra-chunk backward stage on fla-core's own kernel (chunk_kda_bwd_kernel_intra), launched with 64-wide
K-blocks (kernels.kda_intra=fla_k64, and what kda_intra=auto runs where the fused stage does not apply).
moontrain.model.kda.intra is the stage's specification.

fla's wrapper (chunk_kda_bwd_intra) fixes the kernel's K-block at 32 and lets its autotuner search only warps and
stages, so each program of a 16-row sub-chunk re-reads the chunk's [16, 16] tiles of dAqk / dAkk and the other
sub-chunks' k and gates K / 32 times. This launches the same kernel the same way with BK = 64 (K / 64 programs
a sub-chunk). dq, dk and dg sum over the chunk's rows, which the K-block does not split: bitwise fla's call; db
sums its K-blocks' fp32 partials, here K / 64 of them instead of K / 32 (fp32 rounding apart).

Measured (one H100, `benchmarks/diagnostics/kda_intra_tiles.py`, B 4, T 4096, 16 heads of 128, the stage's
inputs from a chunk_kda backward): 0.875 ms against fla's call's 1.078 (BK 128: 0.889); with documents of 1024
tokens 0.893 against 0.965 (docs/performance.md).

The launch mirrors fla-core 0.6.0's wrapper (its arguments, its outputs, its use of lower_bound for the gate
shift) except that outputs are freshly allocated also under use_graph (fla takes static buffers there, for its
CUDA-graph capture, which moontrain does not do).
"""

from __future__ import annotations

import torch

K_BLOCK = 64


def kda_intra_fla(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, dAqk: torch.Tensor,
                  dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, db: torch.Tensor, dg: torch.Tensor,
                  cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                  chunk_size: int = 64, safe_gate: bool = False, lower_bound: float | None = None,
                  use_graph: bool = False, *, block_k: int = K_BLOCK) -> tuple[torch.Tensor, ...]:
    """fla's chunk_kda_bwd_intra (same arguments, same outputs: dq, dk, db, dg) with block_k-wide K-blocks (a
    power of two; fla's wrapper: 32)."""
    import triton
    from fla.ops.kda.chunk_intra import RCP_LN2, chunk_kda_bwd_kernel_intra
    from fla.ops.utils import prepare_chunk_indices
    from fla.utils import IS_GATHER_SUPPORTED

    B, T, H, K, HV = *k.shape, g.shape[2]
    BT, BC, BK = chunk_size, min(16, chunk_size), min(block_k, triton.next_power_of_2(K))
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    NC, NK = triton.cdiv(BT, BC), triton.cdiv(K, BK)
    dq2, dk2 = torch.empty_like(dq), torch.empty_like(dk)
    db2 = beta.new_empty(NK, *beta.shape, dtype=torch.float)
    dg2 = torch.empty_like(dg, dtype=torch.float)
    chunk_kda_bwd_kernel_intra[(NK * NC * NT, B * HV)](
        q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dq2=dq2, dk=dk, dk2=dk2, dg=dg, dg2=dg2, db=db2,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, B=B, T=T, H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK, NC=NC,
        SAFE_GATE=safe_gate, GATE_SHIFT=(-lower_bound if lower_bound is not None else 2.) * RCP_LN2,
        USE_GATHER=IS_GATHER_SUPPORTED, USE_GRAPH=use_graph)
    return dq2, dk2, db2.sum(0).add_(db), dg2
