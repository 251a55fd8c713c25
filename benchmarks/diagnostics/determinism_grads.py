"""Which gradients are not reproducible: the same forward/backward twice from the same state, every
parameter's gradient compared bitwise. Localises a non-deterministic kernel when
benchmarks/check_determinism.py reports a difference (attention weights: SDPA backward; expert masters:
the grouped GEMM or the EP path; router weights: the score gather; the embedding: its backward).

    python -m torch.distributed.run --nproc-per-node 1 benchmarks/diagnostics/determinism_grads.py RECIPE [--strict] [key=value ...]

Runs on every rank of the launch (each compares its own gradients; rank 0 prints its list). Pass
train.deterministic=true or false to compare the two modes; the data of step 0 is used, split into the
recipe's micro-batches. --strict also turns on torch.use_deterministic_algorithms (torch then raises on an
op without a deterministic implementation, naming it).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moontrain.config import RunConfig, from_dict, load_recipe
from moontrain.parallel.layout import build_layout
from moontrain.trainer.determinism import set_cublas_workspace
from moontrain.trainer.trainer import Trainer
from moontrain.trainer.worker import select_device


def _backward(trainer: Trainer, tokens_BT: torch.Tensor, targets_BT: torch.Tensor
              ) -> tuple[float, dict[str, torch.Tensor]]:
    n = trainer.accumulation_steps
    total = 0.0
    for tok_bT, tgt_bT in zip(tokens_BT.chunk(n), targets_BT.chunk(n), strict=True):
        loss, ce = trainer.model(tok_bT, tgt_bT)
        (loss / n).backward()
        total += float(ce) / n
        del loss, ce
    trainer._reduce_grads()
    grads = {}
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().float().clone()
    trainer.optimizer.zero_grad(set_to_none=True)
    for w in trainer.experts:
        w.finish_step(frozenset())
    return total, grads


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    strict = "--strict" in argv
    argv = [a for a in argv if a != "--strict"]
    cfg = from_dict(RunConfig, load_recipe(argv[0], argv[1:]))
    if cfg.train.deterministic or strict:
        set_cublas_workspace()
    if strict:
        torch.use_deterministic_algorithms(True)
    device, backend = select_device()
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        layout = build_layout(cfg.parallel.ep, device)
        trainer = Trainer(cfg, layout)
        batch = trainer.data.batch(0)
        (loss_a, a), (loss_b, b) = _backward(trainer, *batch), _backward(trainer, *batch)
        differ = []
        for name, ga in a.items():
            gb = b[name]
            if not torch.equal(ga, gb):
                differ.append((name, (ga - gb).abs().max().item(), ga.abs().max().item()))
        if layout.rank == 0:
            print(f"train.deterministic={cfg.train.deterministic}: loss {loss_a!r} vs {loss_b!r}; "
                  f"{len(differ)} of {len(a)} gradients differ")
            for name, diff, scale in differ:
                print(f"  {name}: max |diff| {diff:.3e} (max |grad| {scale:.3e})")
        trainer.close()
        return 1 if differ or loss_a != loss_b else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
