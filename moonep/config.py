"""moonep's two config objects: BufferConfig (the static problem of one buffer, in the notation of
docs/moonep.md §3) and BufferOptions (how it runs: the settings a trainer exposes to its users as they are)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

KernelsChoice = Literal["auto", "torch", "triton"]
KERNEL_CHOICES: tuple[str, ...] = ("auto", "torch", "triton")
CombineReduce = Literal["source", "destination"]
COMBINE_REDUCE_CHOICES: tuple[str, ...] = ("source", "destination")
ExpertGemm = Literal["torch", "quack", "quack_wgrad"]
EXPERT_GEMM_CHOICES: tuple[str, ...] = ("torch", "quack", "quack_wgrad")


@dataclass(kw_only=True, slots=True, frozen=True)
class BufferOptions:
    """How a Buffer runs; none of it changes a result, except fused_expert_gemm, expert_gemm and
    combine_reduce (summation orders).

    kernels: data-path implementation, chosen once when the Buffer is built: "torch" (the pure-PyTorch
        specification, moonep.datapath.reference, any device), "triton" (moonep.datapath.triton_path:
        the Triton kernels and the fused planner, CUDA only), "auto" (triton on CUDA, torch elsewhere).
    check_values: data-dependent input checks (expert ids in range, histogram == bincount(topk),
        equal s on every rank). Each costs a device-to-host sync; None means on for a CPU buffer and
        off on CUDA (the GPU hot path).
    timeout_s: a collective call that waits longer than this raises MoonEPTimeoutError.
    num_sms: programs of the persistent dispatch/combine kernels; None means every SM (the reduce push of
        combine_reduce "destination" runs several smaller programs per one of these: dispatch_combine).
    scatter_tile: elements of x one program of the dispatch scatter moves per step (a power of two
        >= 256; 16384 = 32 KiB in bf16 keeps every SM's NVLink stores in flight, benchmarks/bench_comm.py
        --scatter-tile sweeps it).
    fused_expert_gemm: the triton path's expert GEMMs with fused epilogues: gate and up as one grouped
        GEMM with the activation in its epilogue (moonep.kernels.grouped_glu), and the weight gradients
        accumulated straight into the fp32 grads (moonep.kernels.grouped_wgrad). Other summation orders
        than torch._grouped_mm's (within bounds tests/moonep/helpers/grouped_gemm_cases.py derives) and no bf16
        rounding of the weight gradient. Off until measured (benchmarks/bench_expert_gemm.py); needs
        the triton path.
    expert_gemm: the triton path's grouped GEMMs: "torch" (default: torch._grouped_mm, the weight gradient
        added to the fp32 grads by moonep.kernels.experts) or "quack" (quack's CuTe DSL grouped GEMMs,
        moonep.kernels.quack_gemm: the weight gradient added in the GEMM's epilogue; needs sm90 and the
        gpu extra) or "quack_wgrad" (quack for the weight gradient only, torch._grouped_mm for the forward
        and input-gradient GEMMs, where quack's tiles are not faster at every shape). The forward and
        input-gradient products: the torch route's products, summed in an order
        of their own (bitwise equal where measured); the weight gradient skips the bf16 rounding of each
        pass's product. Measured: docs/performance.md.
    combine_reduce: where combine sums a token's rows (docs/moonep.md §6.2). "source" (default, the
        specification's order): the token's rank sums its K rows in fp32, one rounding. "destination":
        each rank first sums the rows of a token it holds and sends one partial row (fewer bytes over
        the links, one more rounding per partial), and moonep.expert_glu hands combine the route
        weights and both dgrad halves (fp32 inside combine). Measured: docs/performance.md.
    """

    kernels: KernelsChoice = "auto"
    check_values: bool | None = None
    timeout_s: float = 120.0
    num_sms: int | None = None
    scatter_tile: int = 16384
    fused_expert_gemm: bool = False
    expert_gemm: ExpertGemm = "torch"
    combine_reduce: CombineReduce = "source"

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"BufferOptions.kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.check_values not in (None, True, False):
            raise ValueError(f"BufferOptions.check_values must be None (on for CPU buffers), True or False, "
                             f"got {self.check_values!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"BufferOptions.timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or self.num_sms < 1):
            raise ValueError(f"BufferOptions.num_sms must be None (every SM) or an int >= 1, got {self.num_sms!r}")
        tile = self.scatter_tile
        if not isinstance(tile, int) or tile < 256 or tile & (tile - 1):
            raise ValueError(f"BufferOptions.scatter_tile must be a power of two >= 256, got {tile!r}")
        if not isinstance(self.fused_expert_gemm, bool):
            raise ValueError(f"BufferOptions.fused_expert_gemm must be True or False, got {self.fused_expert_gemm!r}")
        if self.expert_gemm not in EXPERT_GEMM_CHOICES:
            raise ValueError(f"BufferOptions.expert_gemm must be one of {EXPERT_GEMM_CHOICES}, got {self.expert_gemm!r}")
        if self.fused_expert_gemm and self.expert_gemm != "torch":
            raise ValueError(f"BufferOptions.fused_expert_gemm (moonep's Triton GEMMs) and expert_gemm="
                             f"{self.expert_gemm!r} name two GEMM routes; set one of them")
        if self.combine_reduce not in COMBINE_REDUCE_CHOICES:
            raise ValueError(f"BufferOptions.combine_reduce must be one of {COMBINE_REDUCE_CHOICES}, "
                             f"got {self.combine_reduce!r}")

    def checks_values(self, device: torch.device) -> bool:
        """check_values resolved for a buffer on `device`."""
        return device.type == "cpu" if self.check_values is None else self.check_values


@dataclass(kw_only=True, slots=True, frozen=True)
class BufferConfig:
    """Static sizes of an EP buffer. Everything else (epn, NvS, offsets) is derived in `Layout`.

    max_tokens: S, token capacity per rank per call (1 <= s <= S at each call).
    hidden: H, row width seen by the experts.
    topk: K experts per token.
    num_experts: E routed experts, E % R == 0.
    num_slots: B prefetch slots per rank; None means what the planner can fill (Layout.remote_experts):
        E // R, and 0 on one rank (no remote expert). ExpertPools (training) needs that many: every remote
        expert a rank computes must have a slot.
    token_padding: every non-empty expert group on a rank is padded to a multiple of this.
    dtype: dtype of token rows and expert weights (grads are always fp32).
    entries: entries mode: each of the s rows of a call carries 0 to K (row, expert) entries, an absent
        entry marked by expert id -1 in topk_sK (the host stage of moonep.hierarchical, where a row
        forwarded from another host names only this host's experts). Receive caps split the group's
        total entries T: floor(T/R) + (1 if d < T mod R), computed on the device from the gathered
        histograms (no host sync); every rank passes the same s; the receive shapes stay those of s*K
        entries per rank. PyTorch data path only (BufferOptions.kernels 'auto' picks it; 'triton' is
        refused).
    options: how the buffer runs (BufferOptions).
    """

    max_tokens: int
    hidden: int
    topk: int
    num_experts: int
    num_slots: int | None = None
    token_padding: int = 16
    dtype: torch.dtype = torch.bfloat16
    entries: bool = False
    options: BufferOptions = field(default_factory=BufferOptions)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "topk", "num_experts", "token_padding"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BufferConfig.{name} must be a positive int, got {value!r}")
        if self.topk > self.num_experts and not self.entries:  # entries mode: a row names <= E of its K
            raise ValueError(f"BufferConfig.topk={self.topk} exceeds num_experts={self.num_experts}; "
                             "each token needs topk distinct experts")
        if self.num_slots is not None and (not isinstance(self.num_slots, int) or self.num_slots < 1):
            raise ValueError(f"BufferConfig.num_slots must be None (derived: E // R, 0 on one rank) or an int >= 1, "
                             f"got {self.num_slots!r}")
        if not isinstance(self.entries, bool):
            raise ValueError(f"BufferConfig.entries must be True or False, got {self.entries!r}")
        if not isinstance(self.options, BufferOptions):
            raise ValueError(f"BufferConfig.options must be a moonep.BufferOptions, got {type(self.options).__name__}")
