"""The chunk lists of packed documents, made once per forward instead of once per KDA layer.

With documents, fla's chunk_kda lists the sequences' chunks on the device (its use_graph mode:
fla.ops.utils.index.prepare_chunk_indices_static, ~20 launches of small ops: the lengths, the chunk counts,
their cumulative sum, a searchsorted over the slots, the padding rows) at every call. Every KDA layer of a
forward reads the same sequence bounds (the forward's DocumentMask carries one cu_seqlens tensor for all of
them), so the lists are the same for all: static_chunk_lists keeps them on that tensor (an attribute, so
they live as long as it does) and hands the first call's result to the others; an in-place change of the
tensor (its version counter) makes them anew. share_with_fla points fla's chunk_kda at it (the name its
module imported) and moontrain.model.kda.chunk calls it directly. The lists are read-only inputs of fla's
kernels and of moontrain's; the recipe step's 12 KDA layers make them once a forward, not 12 times.
"""

from __future__ import annotations

import functools

import torch

_ATTR = "_moontrain_kda_chunk_lists"


def static_chunk_lists(cu_seqlens: torch.Tensor, chunk_size: int, nt_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's prepare_chunk_indices_static(cu_seqlens, chunk_size, nt_max): (chunk_indices [nt_max, 2],
    chunk_offsets [num_seqs + 1]), made once per (cu_seqlens tensor and version, chunk_size, nt_max)."""
    from fla.ops.utils.index import prepare_chunk_indices_static

    key = (cu_seqlens._version, chunk_size, nt_max)
    memo = getattr(cu_seqlens, _ATTR, None)
    if memo is None or memo[0] != key:
        memo = (key, prepare_chunk_indices_static(cu_seqlens=cu_seqlens, chunk_size=chunk_size, nt_max=nt_max))
        setattr(cu_seqlens, _ATTR, memo)
    return memo[1]


@functools.cache
def share_with_fla() -> None:
    """Make fla's chunk_kda take its device chunk lists from static_chunk_lists (once per process)."""
    import fla.ops.kda.chunk as fla_chunk

    fla_chunk.prepare_chunk_indices_static = static_chunk_lists
