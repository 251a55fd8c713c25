"""A reference trainer to agree with: a plain PyTorch loop over transformers' DeepseekV3ForCausalLM.

Nothing here imports moontrain: the loop is written from the usual recipe (GPT-2 / nanoGPT style) so
that moontrain's trainer can be checked against an independent implementation of every part of a
step. Both sides start from the same weights (moontrain imports the directory this model is saved
to) and read the same text; tests/moontrain/trainer/test_reference_parity.py and
benchmarks/bench_learning.py compare their per-step losses.

The loop:
- data: documents in file order, each tokenized and followed by the end-of-document id, concatenated
  into one stream; row i of step s is the window stream[(sB + i) T, (sB + i) T + T + 1): inputs the
  first T tokens, targets the last T (a row's last target is the next row's first input). Read by W
  data-parallel ranks (sharded_batches), rank r packs documents r, r + W, ... into its own stream and
  contributes B / W consecutive rows of each global batch;
- loss: mean next-token cross-entropy over every target, in fp32;
- AdamW (torch.optim.AdamW) with weight decay on every matrix except the token embedding, none on
  norms; linear warmup from lr / warmup (step 0) to lr, then cosine to lr * min_lr_ratio at the last
  step; the global gradient norm clipped to `clip` (torch.nn.utils.clip_grad_norm_);
- aux-loss-free balancing: after each step every router's e_score_correction_bias moves by
  rate * (mean count - count_e) / mean count over the experts its gate chose in the step (bias_update
  "proportional"), or by rate * sign(mean count - count_e) ("sign", DeepSeek-V3's rule);
- mean-free router updates (mean_free_router_updates): the optimizer step leaves every gate's weight rows
  unchanged along u, the unit mean of the gate's inputs over the step's tokens (w_e . u is restored).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class LoopConfig:
    lr: float
    warmup_steps: int
    steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: float = 1.0
    bias_update_rate: float = 1e-2
    bias_update: str = "proportional"  # or "sign"
    mean_free_router_updates: bool = True
    batch: int  # rows per step
    seq_len: int


def token_stream(path: str | Path, encode: Callable[[str], list[int]], eos_id: int, text_field: str = "text",
                 shard: tuple[int, int] = (0, 1)) -> Iterator[int]:
    """The documents of a jsonl file in order (shard (r, W): documents r, r + W, ...), each followed by
    eos_id, forever (epochs repeat)."""
    rank, world = shard
    while True:
        with open(path, encoding="utf-8") as fh:
            docs = (line for line in fh if line.strip())
            for i, line in enumerate(docs):
                if i % world == rank:
                    yield from encode(json.loads(line)[text_field])
                    yield eos_id


def batches(stream: Iterator[int], batch: int, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs [batch, T], targets [batch, T]) of consecutive windows of T + 1 tokens with stride T."""
    carry: list[int] = [next(stream)]
    while True:
        rows = []
        for _ in range(batch):
            while len(carry) < seq_len + 1:
                carry.append(next(stream))
            rows.append(carry[:seq_len + 1])
            carry = carry[seq_len:]
        window = torch.tensor(rows, dtype=torch.long)
        yield window[:, :-1], window[:, 1:]


def sharded_batches(path: str | Path, encode: Callable[[str], list[int]], eos_id: int, world: int, batch: int,
                    seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of `batch` rows read by `world` ranks: rank r's batch // world rows, in rank order."""
    ranks = [batches(token_stream(path, encode, eos_id, shard=(r, world)), batch // world, seq_len)
             for r in range(world)]
    while True:
        parts = [next(b) for b in ranks]
        yield torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def lr_at(step: int, cfg: LoopConfig) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed_tokens" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class _ExpertCounts:
    """Counts the experts each router chose during a step (forward hooks on the gates)."""

    def __init__(self, model: nn.Module) -> None:
        self.gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        self.counts = [torch.zeros(g.e_score_correction_bias.numel(), dtype=torch.long,
                                   device=g.e_score_correction_bias.device) for g in self.gates]
        self.input_sums = [torch.zeros(g.weight.shape[1], device=g.weight.device) for g in self.gates]
        for gate, counts, sums in zip(self.gates, self.counts, self.input_sums, strict=True):
            gate.register_forward_hook(self._hook(counts, sums))

    @staticmethod
    def _hook(counts: torch.Tensor, sums: torch.Tensor):
        def hook(module, args, output) -> None:
            sums.add_(args[0].detach().float().reshape(-1, sums.numel()).sum(0))
            # transformers 5.x returns (router_logits, topk_weights, topk_indices), 4.x (topk_indices, topk_weights)
            topk = next(t for t in output if not t.is_floating_point())
            counts.add_(torch.bincount(topk.flatten(), minlength=counts.numel()))
        return hook

    @torch.no_grad()
    def mean_components(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(u, W u) per gate: the unit mean input of the step and each row's component along it."""
        out = []
        for gate, sums in zip(self.gates, self.input_sums, strict=True):
            u = sums / sums.norm().clamp_min(1e-30)
            out.append((u, gate.weight @ u))
            sums.zero_()
        return out

    @torch.no_grad()
    def restore_mean_components(self, held: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for gate, (u, c) in zip(self.gates, held, strict=True):
            gate.weight += torch.outer(c - gate.weight @ u, u)

    @torch.no_grad()
    def update_biases(self, rate: float, rule: str) -> list[float]:
        """Move every bias towards balance; returns each router's maxvio (max / mean count - 1) of the step."""
        maxvio = []
        for gate, counts in zip(self.gates, self.counts, strict=True):
            c = counts.double()
            maxvio.append((c.max() / c.mean() - 1).item())
            if rule == "proportional":
                mean = c.mean().clamp_min(1.0)
                step = rate * (mean - c) / mean
            else:
                step = rate * torch.sign(c.mean() - c)
            gate.e_score_correction_bias += step.to(gate.e_score_correction_bias.dtype)
            counts.zero_()
        return maxvio


def train(model: nn.Module, data: Iterator[tuple[torch.Tensor, torch.Tensor]], cfg: LoopConfig, *,
          device: torch.device, autocast_dtype: torch.dtype | None = None,
          on_step: Callable[[int, float, float], None] | None = None) -> list[dict]:
    """Train `model` for cfg.steps steps; returns per step {loss, grad_norm, lr, maxvio (max over routers)}.
    autocast_dtype: run the forward under torch.autocast (bf16 on a GPU), else in the model's dtype."""
    model.train()
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    counts = _ExpertCounts(model)
    out = []
    for step in range(cfg.steps):
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = next(data)
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        held = counts.mean_components()
        opt.step()
        if cfg.mean_free_router_updates:
            counts.restore_mean_components(held)
        opt.zero_grad(set_to_none=True)
        maxvio = counts.update_biases(cfg.bias_update_rate, cfg.bias_update)
        row = {"step": step + 1, "loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr,
               "maxvio": max(maxvio) if maxvio else 0.0}
        out.append(row)
        if on_step is not None:
            on_step(step + 1, row["loss"], row["maxvio"])
    return out
