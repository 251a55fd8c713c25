"""AdamW over three homogeneous parameter groups.

- decay: dense matrices (attention, FFN, router, latent projections, LM head)
- no_decay: norms, biases and the token embedding (decaying them hurts and buys nothing)
- experts: the fp32 expert masters (this rank's local rows, or with parallel.shard_expert_state this
  replica's shard of them, ExpertWeights.shard_state), decayed like dense matrices

Groups stay homogeneous (DTensor shards vs plain tensors) so the foreach kernels never mix the two.
With optim.write_back the optimizer is WriteBackAdamW: build_optimizer registers each expert master
with its compute tensor (the trainer's write-back targets), and one fused pass steps it, writes the
compute copy and zeroes the grad; with optim.write_back_dense the same for parallel.dense=plain's masters
and their compute copies (which the next forward then takes as they are). build_optimizer builds Muon instead (moontrain.optim.muon) when
optim.name is muon. Every optimizer it returns keeps the contract of moontrain/optim/protocol.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moontrain.optim.config import OptimConfig
from moontrain.optim.muon import build_muon
from moontrain.optim.protocol import TrainOptimizer
from moontrain.optim.schedule import lr_multiplier
from moontrain.optim.torch_adamw import STATE_DTYPES, AdamW
from moontrain.optim.write_back import WriteBackAdamW


def split_param_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "experts": []}
    for name, p in model.named_parameters():
        if ".experts.master." in name:
            groups["experts"].append(p)
        elif p.ndim < 2 or name.endswith(".bias") or "embed" in name:
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int,
                    expert_group: dist.ProcessGroup | None = None,
                    write_back_targets: Iterable[tuple[torch.Tensor, torch.Tensor, bool]] = (),
                    dense_write_back_targets: Iterable[tuple[torch.Tensor, torch.Tensor, bool]] = (),
                    shard_expert_state: bool = False) -> tuple[TrainOptimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and its LR schedule. optim.name picks AdamW (here) or Muon (moontrain.optim.muon;
    expert_group: the expert-data-parallel group, whose replicas share the expert orthogonalisation).
    write_back_targets: (expert master, its compute tensor, zero its grad) per expert projection, stepped
    by the fused write-back pass when optim.write_back is on; dense_write_back_targets: the same for the dense
    masters of parallel.dense=plain (its compute copies), stepped so when optim.write_back_dense (default: as
    optim.write_back) is on. shard_expert_state: the expert masters are
    their replica's shards (parallel.shard_expert_state), which only plain AdamW steps."""
    if shard_expert_state and cfg.name == "muon":
        raise ValueError("parallel.shard_expert_state=true is built for AdamW only: Muon orthogonalises whole expert "
                         "matrices over the replicas; set optim.name=adamw or parallel.shard_expert_state=false")
    if cfg.name == "muon":
        return build_muon(model, cfg, total_steps, expert_group=expert_group)
    groups = split_param_groups(model)
    param_groups = [
        {"params": groups["decay"], "weight_decay": cfg.weight_decay, "name": "decay"},
        {"params": groups["no_decay"], "weight_decay": 0.0, "name": "no_decay"},
        {"params": groups["experts"], "weight_decay": cfg.weight_decay, "name": "experts"},
    ]
    param_groups = [g for g in param_groups if g["params"]]
    fused = cfg.fused
    if fused is None:  # one multi-tensor kernel per group instead of foreach's chain of ops (GPU only)
        fused = all(p.device.type == "cuda" for g in param_groups for p in g["params"])
    write_back = fused if cfg.write_back is None else cfg.write_back
    if write_back and shard_expert_state:
        raise ValueError("parallel.shard_expert_state=true is not built for the fused write-back AdamW "
                         "(optim.write_back=true, the default with optim.fused on a GPU); set optim.write_back=false "
                         "or parallel.shard_expert_state=false")
    on_cpu = any(p.device.type != "cuda" for g in param_groups for p in g["params"])
    if write_back and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("optim.write_back=true runs a Triton kernel and needs the parameters on a GPU; set "
                         "optim.write_back=false (or leave it unset: it follows optim.fused) on the CPU")
    opt_cls = WriteBackAdamW if write_back else AdamW
    state_dtype = STATE_DTYPES[cfg.state_dtype]
    if state_dtype != torch.float32:  # torch's fused kernel takes moments of the parameters' dtype only
        fused = False
    opt = opt_cls(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None,
                  state_dtype=state_dtype)
    write_back_dense = write_back if cfg.write_back_dense is None else cfg.write_back_dense
    if write_back_dense and not write_back:
        raise ValueError("optim.write_back_dense=true needs the fused write-back AdamW, off here (optim.write_back "
                         "follows optim.fused, which is off on the CPU); set optim.write_back=true or "
                         "optim.write_back_dense=false")
    if write_back:
        for master, compute, zero_grad in write_back_targets:
            opt.register_write_back(master, compute, zero_grad=zero_grad)
    if write_back_dense:
        for master, compute, zero_grad in dense_write_back_targets:
            opt.register_write_back(master, compute, zero_grad=zero_grad)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_multiplier(step, cfg, total_steps))
    return opt, sched
