"""BufferConfig: the static problem of one moonep buffer (SPEC section 3 notation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class BufferConfig:
    """Static sizes of an EP buffer. Everything else (epn, NvS, offsets) is derived in `Layout`.

    max_tokens: S, token capacity per rank per call (1 <= s <= S at each call).
    hidden: H, row width seen by the experts.
    topk: K experts per token.
    num_experts: E routed experts, E % R == 0.
    num_slots: B prefetch slots per rank; None means E // R, which training requires.
    token_padding: every non-empty expert group on a rank is padded to a multiple of this.
    dtype: dtype of token rows and expert weights (grads are always fp32).
    timeout_s: a collective call that waits longer than this raises MoonEPTimeoutError.
    plan_graph: on CUDA, replay the planner from a CUDA graph captured once per shape (bitwise the
        same plan, one host launch instead of ~400; the first call per shape captures, a host sync).
    fused_planner: on the triton path, plan() is moonep.kernels.plan_fused (histogram exchange and
        the whole planner in three kernels); False falls back to the PyTorch planner with the shared
        part as one Triton kernel (moonep.kernels.planner), graph-replayed when plan_graph is on.
    check_values: data-dependent input checks (expert ids in range, histogram == bincount(topk),
        equal s on every rank). Each costs a device-to-host sync, so the GPU hot path turns it off.
    kernels: data-path implementation: "torch" (the pure-PyTorch specification, any device),
        "triton" (moonep.kernels, CUDA only), "auto" (triton on CUDA, torch on the CPU).
    num_sms: programs of the persistent dispatch/combine kernels; None means every SM.
    expert_kernels: on the triton path, also run prefetch_weight / reduce_grad as the kernels of
        moonep.kernels.experts (they touch occupied slots only); bitwise equal to the PyTorch
        path (Triton's interpreter in CI, tests/moonep/gpu/test_expert_kernels.py on 2xH200).
    """

    max_tokens: int
    hidden: int
    topk: int
    num_experts: int
    num_slots: int | None = None
    token_padding: int = 16
    dtype: torch.dtype = torch.bfloat16
    timeout_s: float = 120.0
    check_values: bool = True
    kernels: str = "auto"
    num_sms: int | None = None
    expert_kernels: bool = True

    plan_graph: bool = True
    fused_planner: bool = True

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "topk", "num_experts", "token_padding"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BufferConfig.{name} must be a positive int, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"BufferConfig.topk={self.topk} exceeds num_experts={self.num_experts}; "
                             "each token needs topk distinct experts")
        if self.num_slots is not None and (not isinstance(self.num_slots, int) or self.num_slots < 1):
            raise ValueError(f"BufferConfig.num_slots must be None (= E // R) or an int >= 1, got {self.num_slots!r}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"BufferConfig.kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or self.num_sms < 1):
            raise ValueError(f"BufferConfig.num_sms must be None (every SM) or an int >= 1, got {self.num_sms!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"BufferConfig.timeout_s must be > 0, got {self.timeout_s}")
