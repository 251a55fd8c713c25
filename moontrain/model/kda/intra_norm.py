"""The specification of moontrain.model.kda.intra_norm_kernel (kernels.kda_intra=moontrain): KDA's intra-chunk
backward stage (moontrain.model.kda.intra) followed by the L2 norms' backward of the gate-and-norm route
(moontrain.model.kda.gate_norm), composed. The gate's backward, the route's last launch, is left out: it runs
after the fused kernel on the dg that both produce. The gates the kernel takes (a lower bound in [-10, 0)) are
decided here too, without Triton: kernels.kda_intra=auto resolves by them (moontrain.model.kda.layer)."""

from __future__ import annotations

import torch

from moontrain.model.kda.gate_norm import kda_gate_norm_backward_reference
from moontrain.model.kda.intra import kda_intra_reference

STAGE_OUTPUTS = ("dq_in", "dk_in", "db", "dg")
LOWEST_BOUND = -10.0  # the diagonal block's factors reach 2^(8 |lower bound| / ln 2): < 2^116 down to here


def takes_lower_bound(lower_bound: float | None) -> bool:
    """Whether the fused kernel takes the gate: bounded, in [LOWEST_BOUND, 0), so that its diagonal blocks'
    factors stay finite in fp32."""
    return lower_bound is not None and LOWEST_BOUND <= lower_bound < 0


def check_lower_bound(lower_bound: float | None) -> None:
    """Refuse a gate whose diagonal blocks' factors could leave fp32 (kernels.kda_intra=fla_k64 takes it)."""
    if not takes_lower_bound(lower_bound):
        raise ValueError(f"kernels.kda_intra=moontrain takes a gate lower bound in [{LOWEST_BOUND}, 0) (its "
                         f"diagonal blocks' factors stay finite in fp32 there), got model.kda_gate_lower_bound="
                         f"{lower_bound}; set kernels.kda_intra=fla_k64 (or auto) for this gate")


def kda_intra_norm_reference(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             dAqk: torch.Tensor, dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                             db: torch.Tensor, dg: torch.Tensor, q_rstd: torch.Tensor, k_rstd: torch.Tensor, *,
                             lower_bound: float | None, cu_seqlens: torch.Tensor | None = None,
                             chunk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(dq_in, dk_in, db, dg) in the inputs' precision, at least fp32 (unrounded: float64 inputs give float64),
    q and k the normalised rows the forward stored, q_rstd and k_rstd their reciprocal norms."""
    dq, dk, db, dg = kda_intra_reference(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens=cu_seqlens,
                                         chunk_indices=chunk_indices, safe_gate=lower_bound is not None,
                                         lower_bound=lower_bound)
    H, K = k.shape[2:]
    p = dq.dtype
    gate = dict(f=torch.zeros_like(dq), A_log=torch.zeros(H, dtype=p, device=dq.device),
                dt_bias=torch.zeros(H * K, dtype=p, device=dq.device), lower_bound=lower_bound,
                cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    dq_in, dk_in, *_ = kda_gate_norm_backward_reference(dq, dk, dg, q.to(p), q_rstd.to(p), k.to(p), k_rstd.to(p),
                                                        **gate)
    return dq_in, dk_in, db, dg
