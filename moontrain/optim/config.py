"""Optimizer and learning-rate schedule configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    # adamw: AdamW everywhere. muon: Muon for the matrices (dense and per expert), AdamW for the embedding,
    # head, norms and router weights (moontrain.optim.muon); lr and weight_decay carry over
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4  # the peak learning rate (after warmup)
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1  # decoupled weight decay of the matrices and experts (not the embedding, 1-D params)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    warmup_steps: int = 0  # the lr rises linearly to its peak over these steps
    # after warmup: cosine (down to min_lr over the schedule), wsd (warmup-stable-decay: the peak, then a linear
    # decay over the last decay_fraction), constant (the peak throughout)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr
    # the steps the schedule spans (None: train.steps); steps past it run at the final lr. A resumed run whose
    # train.steps changed continues on the new span unless this keeps the old one (the worker names the change)
    schedule_steps: int | None = None
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    fused: bool | None = None  # torch's fused AdamW kernels; None: on when the parameters are on a GPU
    # expert masters: one Triton pass per projection for the AdamW step, the compute-copy write and the
    # grad zeroing (moontrain.optim.write_back); None: on when `fused` is on
    write_back: bool | None = None
    # parallel.dense=plain's fp32 masters through the same pass: the step writes their compute copies, which the
    # next forward then uses without a cast; None: follows write_back. Off, torch's fused AdamW steps them,
    # bit for bit what FSDP2 does at one rank (moontrain.parallel.plain_dense)
    write_back_dense: bool | None = None
    # AdamW's moments (exp_avg, exp_avg_sq): float32, or bfloat16 (DeepSeek-V3's choice: half their memory and 22
    # bytes of write-back traffic a parameter instead of 30; the masters and the math stay fp32,
    # moontrain.optim.torch_adamw). AdamW only (optim.name=adamw)
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    muon_momentum: float = 0.95  # Muon's momentum coefficient
    muon_nesterov: bool = True  # Nesterov momentum in Muon
    muon_ns_steps: int = 5  # quintic Newton-Schulz iterations
    muon_per_head_qkv: bool = False  # orthogonalise each head's query, key and value rows separately (K3)
    # QK-Clip (moontrain.optim.qk_clip): after each step, rescale the query/key weights of every attention
    # head whose maximum attention logit exceeded this threshold back to it (Kimi K2 uses 100); 0 disables
    qk_clip_tau: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"optim.name must be 'adamw' or 'muon', got {self.name!r}")
        if self.name == "muon" and self.write_back_dense:
            raise ValueError("optim.write_back_dense=true is the fused AdamW step of the dense masters; with "
                             "optim.name=muon leave optim.write_back_dense unset (or false)")
        if self.write_back is False and self.write_back_dense:
            raise ValueError("optim.write_back_dense=true needs the fused write-back AdamW, which optim.write_back=false "
                             "turns off; set optim.write_back=true (or unset) or optim.write_back_dense=false")
        if self.name == "muon" and self.write_back:
            raise ValueError("optim.write_back=true is the fused AdamW expert step; with optim.name=muon leave "
                             "optim.write_back unset (or false)")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"optim.state_dtype must be 'float32' or 'bfloat16', got {self.state_dtype!r}")
        if self.state_dtype != "float32" and self.fused:
            raise ValueError("optim.fused=true is torch's fused AdamW, whose moments are the parameters' dtype; with "
                             "optim.state_dtype=bfloat16 leave optim.fused unset (the write-back pass steps the "
                             "masters on a GPU)")
        if self.name == "muon" and self.state_dtype != "float32":
            raise ValueError("optim.state_dtype=bfloat16 is built for AdamW's moments; with optim.name=muon set "
                             "optim.state_dtype=float32 (recipes/k3_small.yaml sets bfloat16 for its AdamW)")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_steps < 1:
            raise ValueError(f"optim.muon_ns_steps must be >= 1, got {self.muon_ns_steps}")
        if not 0 <= self.qk_clip_tau < math.inf:
            raise ValueError(f"optim.qk_clip_tau must be a finite number >= 0 (0 disables QK-Clip), got {self.qk_clip_tau}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if not 0 < self.eps < math.inf:
            raise ValueError(f"optim.eps must be a finite number > 0 (AdamW divides by sqrt(v) + eps; 1e-8 is usual), "
                             f"got {self.eps}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optim.weight_decay must be a finite number >= 0 (0 disables), got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise ValueError(f"optim.schedule_steps must be >= 1 or null (null: train.steps), got {self.schedule_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.grad_clip < math.inf:
            raise ValueError(f"optim.grad_clip must be a finite number >= 0 (0 disables), got {self.grad_clip}")
