"""The exact causal maximum attention logit per head: what QK-Clip (moontrain.optim.qk_clip) measures.

Legend: B batch, N heads, T sequence, d q/k head dim, c query rows per chunk, S key positions.

SDPA does not return its logits, so `causal_max_logit` is a separate pass over the same q and k (after
rope, before SDPA): the exact causal maximum of scale * q.k per head (within each document for packed
rows with document masking, the logits the attention computes), in chunks of query rows (peak memory
B * N * c * T scores), under no_grad. The products run in the compute dtype with fp32 accumulation;
bf16 scores are rounded once, and rounding is monotone, so the measured maximum is the true one up to
one bf16 rounding (relative 2^-9). Cost: the QK^T half of the attention forward again (causal: the
chunks stop at the diagonal), no backward. MLAttention folds it into its running maximum while QK-Clip
is on; activation-checkpointing recomputes measure the same values again (the maximum is idempotent).
"""

from __future__ import annotations

import math

import torch

_SCORES_PER_CHUNK = 1 << 24  # scores materialised per chunk (64 MiB in fp32)


@torch.no_grad()
def causal_max_logit(q_BNTd: torch.Tensor, k_BNTd: torch.Tensor, scale: float,
                     doc_id_BT: torch.Tensor | None = None) -> torch.Tensor:
    """max over batch, query t and key s <= t (of t's document when doc_id_BT is given: the logits the
    attention computes) of scale * q[b, h, t] . k[b, h, s], per head h (fp32 [N])."""
    B, N, T, _ = q_BNTd.shape
    chunk = max(1, min(T, _SCORES_PER_CHUNK // max(1, B * N * T)))
    out_N = torch.full((N,), -math.inf, dtype=torch.float32, device=q_BNTd.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        s_BNcS = torch.matmul(q_BNTd[:, :, t0:t1], k_BNTd[:, :, :t1].transpose(-1, -2)).float()
        t_c = torch.arange(t0, t1, device=q_BNTd.device)
        hidden_BcS = (torch.arange(t1, device=q_BNTd.device)[None, :] > t_c[:, None]).unsqueeze(0)
        if doc_id_BT is not None:
            hidden_BcS = hidden_BcS | (doc_id_BT[:, t0:t1, None] != doc_id_BT[:, None, :t1])
        s_BNcS.masked_fill_(hidden_BcS.unsqueeze(1), -math.inf)
        out_N = torch.maximum(out_N, s_BNcS.amax(dim=(0, 2, 3)) * scale)
    return out_N
