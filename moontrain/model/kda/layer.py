"""The Kimi Delta Attention (KDA) layer of the hybrid K3 stack (Kimi Linear's linear attention).

Legend: B batch, T sequence, D hidden, H KDA heads, K KDA head dim (keys and values), W conv taps, r gate rank.

    q, k, v = silu(conv_W(x W_q)), silu(conv_W(x W_k)), silu(conv_W(x W_v))   causal depthwise short convs
    f       = x W_f  (full rank, or low rank x W_fa W_fb)                       raw per-channel forget input
    g       = bound * sigmoid(exp(A_log_h) (f + dt_bias))   (or -exp(A_log_h) softplus(f + dt_bias))
    beta    = sigmoid(x W_b)                                                    one write strength per head
    o       = KDA(l2norm(q), l2norm(k), v, g, beta)        (moontrain.model.kda.ops: spec and fla kernel)
    out     = (RMSNorm_K(o) * sigmoid(x W_g)) W_o          per-head gated RMSNorm, output gate like W_f
Parameter names and layouts are Kimi Linear's (q_proj, q_conv1d [C, 1, W] in nn.Conv1d's tap order,
f_a_proj / f_b_proj or the full-rank f_proj, b_proj, A_log, dt_bias [H * K], g_*_proj, o_norm, o_proj), so
the Hugging Face export maps them one to one. The short convolutions see no token of an earlier document (taps
across a document start are zeroed), and the recurrence restarts at each document start, so nothing crosses an
end-of-document.
No positional encoding: the recurrence and the convolutions are order-aware. The six input projections
(q, k, v, f or f_a, g or g_a, b) run as one GEMM over their stacked weights (project); the parameters stay
separate, under their names.

Kernel: kernels.kda picks ops.kda (pure PyTorch, chunked; CPU and GPU) or ops.kda_fla
(fla-core's chunk_kda, Triton, with the gate and the L2 norm fused) once, at construction; kernels.short_conv
likewise the convolutions (short_conv, or moontrain.model.kda.short_conv_kernel's Triton kernel, which reads
project()'s column slices in place and which torch.compile traces through); kernels.kda_dqkg and
kernels.kda_intra which kernels run the two fla backward stages moontrain.model.kda.dqkg and kda_intra specify
(fla's, or moontrain's: moontrain.model.kda.fla_backend routes them; kda_intra=auto: resolve_intra);
kernels.kda_gate_norm whether fla's chunk_kda runs the call or moontrain.model.kda.chunk (fla's stages between
moontrain's gate-and-norm kernels; there kernels.kda_walk=auto or moontrain runs the forward's state walk and
output as one kernel, moontrain.model.kda.walk_kernel). The KDA call is excluded from torch.compile (fla's autograd function is
opaque to it; the reference's chunk loop would unroll); the projections, convolutions and the output norm around
it compile, with inductor's comprehensive padding off (compile(): the convolutions' Triton launches carry the
projection's strides as traced, so a padded projection output would be copied, slice by slice, in forward and
backward).

Init (init_parameters, after the model's normal init): A_log = log U(1, 16) per head (fla's range), dt_bias
so that the initial decay rate -g at f = 0 is log-uniform in [1e-3, 1e-1] per channel (Mamba-2's range for
the step: long and short memories from the start), conv taps U(+-1/sqrt(W)) (nn.Conv1d's default).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moontrain.model.config import ModelConfig
from moontrain.model.documents import DocumentMask
from moontrain.model.kda.intra_norm import takes_lower_bound
from moontrain.model.kda.ops import at_least_fp32, kda, kda_fla
from moontrain.model.kda.short_conv import select_short_conv

DECAY_RATE_RANGE = (1e-3, 1e-1)


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def resolve_intra(intra: str, gate_norm: str, lower_bound: float | None) -> str:
    """kernels.kda_intra as the layer runs it: "auto" is moontrain's fused intra+norm stage where it applies (the
    gate-and-norm route, kernels.kda_gate_norm=moontrain, with a gate the kernel takes: a lower bound in
    [-10, 0)), fla_k64 elsewhere; the other values are themselves."""
    if intra != "auto":
        return intra
    return "moontrain" if gate_norm == "moontrain" and takes_lower_bound(lower_bound) else "fla_k64"


def select_kda_kernel(choice: str, device: torch.device | str | None) -> Callable[..., torch.Tensor]:
    """The KDA function of kernels.kda = `choice` (auto, torch or fla) on `device`."""
    if choice == "torch":
        return kda
    if choice == "fla":
        if not fla_available():
            raise ValueError("kernels.kda=fla needs fla-core (pip install fla-core, or on the GPU machine "
                             "bash ../shared/device/stage.sh fla); kernels.kda=torch runs the PyTorch KDA")
        return kda_fla
    on_cuda = device is not None and torch.device(device).type == "cuda"
    return kda_fla if on_cuda and fla_available() else kda


def kda_fallback_warning(cfg: ModelConfig, choice: str, device: torch.device | str | None) -> str | None:
    """The warning a run gets where kernels.kda=auto leaves the KDA layers on the PyTorch KDA on a GPU because
    fla-core is not installed (None where that is not so): that path keeps [B, H, T, 64, K] fp32 decays a layer
    and runs the recipes' batches out of memory, so the job says it before the first step, not in an OOM."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if cfg.kda_layers_per_mla == 0 or choice != "auto" or not on_cuda or fla_available():
        return None
    return ("warning: kernels.kda=auto runs the KDA layers on the PyTorch KDA on this GPU because fla-core is not "
            "installed; it keeps [batch, heads, tokens, 64, head_dim] fp32 decays per layer and runs a recipe's batch "
            "out of memory. Install the GPU extras (pip install -e '.[gpu]'), or write kernels.kda=torch to keep it")


def uses_fla(cfg: ModelConfig, choice: str, device: torch.device | str | None) -> bool:
    """Whether the model's KDA layers (if any) run fla's kernels on `device` under kernels.kda = `choice`."""
    return cfg.kda_layers_per_mla > 0 and select_kda_kernel(choice, device) is kda_fla


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels (at least fp32), times sigmoid of the output gate."""

    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = at_least_fp32(x)
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * at_least_fp32(self.weight)
        return (y * torch.sigmoid(at_least_fp32(gate))).to(gate.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, kernel: str = "auto", conv: str = "auto", conv_backward: str = "tiles",
                 recompute: bool = False,
                 dqkg: str = "moontrain", intra: str = "auto", gate_norm: str = "moontrain", walk: str = "auto",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        D, H, K, W, r = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size, cfg.kda_gate_rank
        self.q_proj = nn.Linear(D, H * K, bias=False, device=device)
        self.k_proj = nn.Linear(D, H * K, bias=False, device=device)
        self.v_proj = nn.Linear(D, H * K, bias=False, device=device)
        self.q_conv1d = nn.Parameter(torch.empty(H * K, 1, W, device=device))
        self.k_conv1d = nn.Parameter(torch.empty(H * K, 1, W, device=device))
        self.v_conv1d = nn.Parameter(torch.empty(H * K, 1, W, device=device))
        if r is None:
            self.f_proj = nn.Linear(D, H * K, bias=False, device=device)
            self.g_proj = nn.Linear(D, H * K, bias=False, device=device)
        else:
            self.f_a_proj = nn.Linear(D, r, bias=False, device=device)
            self.f_b_proj = nn.Linear(r, H * K, bias=False, device=device)
            self.g_a_proj = nn.Linear(D, r, bias=False, device=device)
            self.g_b_proj = nn.Linear(r, H * K, bias=False, device=device)
        self.b_proj = nn.Linear(D, H, bias=False, device=device)
        self.A_log = nn.Parameter(torch.zeros(H, device=device))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, device=device))  # 1-D: no weight decay, like A_log
        self.o_norm = GatedRMSNorm(K, cfg.norm_eps, device=device)
        self.o_proj = nn.Linear(H * K, D, bias=False, device=device)
        self.kernel = select_kda_kernel(kernel, device)  # kernel: kernels.kda; called by recurrence()
        if self.kernel is kda_fla:
            from moontrain.model.kda.fla_backend import route_fla_stages  # imports fla: only where fla runs

            intra = resolve_intra(intra, gate_norm, cfg.kda_gate_lower_bound)

            # kernels.kda_dqkg / kda_intra: process-wide, as fla's choice is (kda_intra=moontrain is no fla stage: its
            # kernel runs inside moontrain's gate-and-norm route, which leaves fla's dispatch to the other layers)
            route_fla_stages(dqkg=dqkg, intra=intra if intra != "moontrain" else "fla_k64")
            # recompute: kernels.kda_recompute; gate_norm: kernels.kda_gate_norm; walk: kernels.kda_walk
            self.kernel = functools.partial(kda_fla, recompute=recompute, gate_norm=gate_norm == "moontrain",
                                            intra_norm=intra == "moontrain",
                                            walk=walk == "moontrain" or (walk == "auto" and gate_norm == "moontrain"))
        # recurrence() outside torch.compile; wrapped here, not as a decorator, which would import torch._dynamo
        # (and with it triton) with this module; the class's function, not a bound method (copies stay apart)
        self._uncompiled_recurrence = torch.compiler.disable(KimiDeltaAttention.recurrence)
        # conv / conv_backward: kernels.short_conv / short_conv_backward (traceable by torch.compile)
        self.conv = select_short_conv(conv, device, conv_backward)

    def compile(self, **kwargs) -> None:
        """nn.Module.compile with inductor's comprehensive padding off unless `options` says otherwise. Padding
        gives the stacked projection's output (5 H K + H columns: 10,256 at k3_small) a row stride rounded up
        to 128 bytes. The short convolutions' Triton launches (torch.library.triton_ops) pass the strides of
        their input as traced, unpadded, so inductor then copies each q / k / v column slice to those strides
        before the forward's and the backward's kernels: six [B, T, H K] copies a layer and pass. torch 2.11
        pads it (its contiguity query pads the layout it inspects); the layer's other buffers need no padding
        (widths of whole 128-byte rows). Off, the kernels read the projection's columns in place."""
        options = {"comprehensive_padding": False, **(kwargs.pop("options", None) or {})}
        super().compile(options=options, **kwargs)

    @torch.no_grad()
    def init_parameters(self, gen: torch.Generator) -> None:
        """A_log, dt_bias and the conv taps (see the module docstring); the rest keeps the model's init."""
        H, K, W = self.cfg.kda_heads, self.cfg.kda_head_dim, self.cfg.kda_conv_size
        dev = self.A_log.device
        self.A_log.copy_(torch.empty(H, device=dev).uniform_(1.0, 16.0, generator=gen).log())
        lo, hi = DECAY_RATE_RANGE
        rate_HK = torch.exp(torch.empty(H, K, device=dev).uniform_(math.log(lo), math.log(hi), generator=gen))
        a_H1 = self.A_log.exp().unsqueeze(-1)
        bound = self.cfg.kda_gate_lower_bound
        if bound is None:  # rate = a softplus(dt)
            self.dt_bias.copy_(torch.log(torch.expm1(rate_HK / a_H1)).flatten())
        else:  # rate = -bound sigmoid(a dt)
            self.dt_bias.copy_((torch.logit(rate_HK / -bound) / a_H1).flatten())
        for w in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            w.uniform_(-1 / math.sqrt(W), 1 / math.sqrt(W), generator=gen)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                docs: DocumentMask | None = None) -> torch.Tensor:
        """cos/sin are unused (no positional encoding); the signature is MLAttention's."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        H, K = cfg.kda_heads, cfg.kda_head_dim
        doc_id = docs.id_BT if docs is not None else None
        q_in, k_in, v_in, f_in, g_in, b_in = self.project(x_BTD)
        q_BTHK = self.conv(q_in, self.q_conv1d, doc_id).view(B, T, H, K)
        k_BTHK = self.conv(k_in, self.k_conv1d, doc_id).view(B, T, H, K)
        v_BTHK = self.conv(v_in, self.v_conv1d, doc_id).view(B, T, H, K)
        f_BTHK = self.forget(f_in).view(B, T, H, K)
        beta_BTH = torch.sigmoid(at_least_fp32(b_in))
        o_BTHK = self._uncompiled_recurrence(self, q_BTHK, k_BTHK, v_BTHK, f_BTHK, beta_BTH, docs)
        o_BTHK = self.o_norm(o_BTHK, self.output_gate(g_in).view(B, T, H, K))
        return self.o_proj(o_BTHK.reshape(B, T, H * K))

    def recurrence(self, q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHK: torch.Tensor, f_BTHK: torch.Tensor,
                   beta_BTH: torch.Tensor, docs: DocumentMask | None) -> torch.Tensor:
        """The KDA kernel (kernels.kda), outside torch.compile: fla's autograd function is opaque to it and the
        reference's chunk loop would unroll. The documents are read here, where torch.compile installs no
        guards on them: the sequence bounds' length changes with every batch."""
        return self.kernel(q_BTHK, k_BTHK, v_BTHK, f_BTHK, beta_BTH, self.A_log, self.dt_bias,
                           lower_bound=self.cfg.kda_gate_lower_bound, scale=self.cfg.kda_head_dim ** -0.5,
                           doc_start_BT=docs.start_BT if docs is not None else None,
                           seq_bounds=docs.seq_bounds if docs is not None else None)

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The six input projections of x (q, k, v before their convolutions, f or f_a, g or g_a, beta's
        logits) as column slices of one GEMM over the stacked weights: one GEMM forward and one dgrad and
        one wgrad GEMM backward instead of six each, and no sum of six input gradients."""
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        if self.cfg.kda_gate_rank is None:
            weights += [self.f_proj.weight, self.g_proj.weight]
        else:
            weights += [self.f_a_proj.weight, self.g_a_proj.weight]
        weights.append(self.b_proj.weight)
        return F.linear(x_BTD, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)

    def forget(self, f_in: torch.Tensor) -> torch.Tensor:
        """The raw forget-gate input f (before dt_bias and the gate's nonlinearity) from project()'s slice."""
        return f_in if self.cfg.kda_gate_rank is None else self.f_b_proj(f_in)

    def output_gate(self, g_in: torch.Tensor) -> torch.Tensor:
        """The output gate's input (sigmoid in o_norm) from project()'s slice."""
        return g_in if self.cfg.kda_gate_rank is None else self.g_b_proj(g_in)
