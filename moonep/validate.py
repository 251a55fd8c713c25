"""Boundary checks of moonep's public calls (docs/moonep.md §8): ValueError naming value and fix."""

from __future__ import annotations

import torch

from moonep.layout import Layout


def check_tensor(name: str, t: torch.Tensor, *, shape: tuple[int, ...], dtype: torch.dtype | tuple[torch.dtype, ...],
                 device: torch.device) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}; convert it with .to()")
    if t.device.type != device.type:
        raise ValueError(f"{name} is on {t.device}, expected the buffer's device {device}; move it with .to()")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {t.stride()}); call .contiguous() first")


def check_num_tokens(layout: Layout, s: int) -> None:
    S = layout.config.max_tokens
    if not 1 <= s <= S:
        raise ValueError(f"this call has s={s} tokens, but a buffer built with max_tokens S={S} takes "
                         f"1 <= s <= {S}; split the batch or build the buffer with a larger max_tokens")


ENTRIES_TOTAL = ("total_num_tokens does not apply to an entries-mode buffer (BufferConfig.entries): its receive caps "
                 "come from the gathered entry counts; pass the same number of rows on every rank and no total")


def check_expert_ids(layout: Layout, topk_sK: torch.Tensor) -> None:
    """Data-dependent (host sync): every expert id in [0, E) ([-1, E) in entries mode: -1 is no entry)."""
    E = layout.config.num_experts
    low = -1 if layout.config.entries else 0
    lo, hi = int(topk_sK.min()), int(topk_sK.max())
    if lo < low or hi >= E:
        bad = lo if lo < low else hi
        allowed = "[-1, E) (-1: no entry)" if layout.config.entries else "[0, E)"
        raise ValueError(f"topk_sK holds expert id {bad}, outside [{low}, {E}); routing must pick ids in {allowed}")


def entry_histogram(topk_sK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: entries per expert, absent entries (-1) not counted."""
    ids = topk_sK.reshape(-1).long()
    return torch.bincount(ids[ids >= 0], minlength=num_experts)


def check_routing_values(layout: Layout, topk_sK: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> None:
    """Data-dependent checks (host sync): ids in range, distinct per token, histogram matches."""
    E = layout.config.num_experts
    check_expert_ids(layout, topk_sK)
    sorted_sK = torch.sort(topk_sK, dim=1).values
    dup = ((sorted_sK[:, 1:] == sorted_sK[:, :-1]) & (sorted_sK[:, 1:] >= 0)).any(dim=1)
    if bool(dup.any()):
        t = int(torch.nonzero(dup)[0, 0])
        raise ValueError(f"token {t} routes to the same expert twice: {topk_sK[t].tolist()}; "
                         "each token needs topk distinct experts")
    expected = entry_histogram(topk_sK, E)
    if not torch.equal(expected, tokens_per_expert_E.long()):
        e = int(torch.nonzero(expected != tokens_per_expert_E.long())[0, 0])
        raise ValueError(f"tokens_per_expert_E[{e}]={int(tokens_per_expert_E[e])} but topk_sK routes "
                         f"{int(expected[e])} tokens to expert {e}; pass the histogram of topk_sK (or None)")


def check_counts(layout: Layout, counts_RE: torch.Tensor) -> None:
    """Data-dependent (host sync): every rank's histogram is non-negative, sums to a multiple of K
    (s tokens times K; any count in entries mode) and to at most S * K."""
    K, S = layout.config.topk, layout.config.max_tokens
    if bool((counts_RE < 0).any()):
        r, e = torch.nonzero(counts_RE < 0)[0].tolist()
        raise ValueError(f"counts_RE[{r}, {e}]={int(counts_RE[r, e])} is negative; a histogram counts tokens")
    for r, total in enumerate(counts_RE.long().sum(1).tolist()):
        if (total % K and not layout.config.entries) or total > S * K:
            raise ValueError(f"rank {r}'s histogram sums to {total}, not s*K for a whole number of tokens "
                             f"1 <= s <= S={S} (K={K}); pass the bincount of every rank's topk_sK")


def check_gathered_counts(layout: Layout, counts_RE: torch.Tensor, s: int, total_num_tokens: int | None) -> None:
    """After the histogram exchange every rank sees every s; the same error is raised on all ranks."""
    K = layout.config.topk
    if layout.config.entries:  # every rank has s rows of at most K entries each
        totals = counts_RE.long().sum(1).tolist()
        if max(totals) > s * K:
            raise ValueError(f"entries-mode ranks hold {totals} entries, more than s*K={s * K} for the s={s} rows "
                             "of this call; every rank must pass the same number of rows, each with at most K entries")
        return
    per_rank = (counts_RE.long().sum(1) // K).tolist()
    if total_num_tokens is None:
        if any(n != per_rank[0] for n in per_rank):
            raise ValueError(f"s differs across ranks: {per_rank}; pass total_num_tokens={sum(per_rank)} "
                             "to dispatch for per-rank token counts, or give every rank the same s")
    elif sum(per_rank) != total_num_tokens:
        raise ValueError(f"total_num_tokens={total_num_tokens} but the ranks hold {per_rank} tokens "
                         f"(sum {sum(per_rank)}); pass the true total")
