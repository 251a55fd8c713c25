"""Mean-free router updates: an optimizer step cannot make an expert more or less popular with every token.

Legend: L MoE layers, E experts, D hidden.

Why (docs/learning.md, "Routing"): early in training the loss gradient is much the same for every token
(the model first learns token frequencies), so the gradient of a router row w_e points along the mean
router input u (the normed residual stream has a mean over tokens). AdamW turns a consistent gradient
into a step of ~lr per element, so w_e . u moves by ~lr * |u|_1 per step, the same shift of expert e's
logit for every token: at D = 2048 and lr 6e-4 about 0.3 logit per step, while the aux-loss-free bias
corrects a score by router_bias_update_rate (1e-3) per step. Measured on one H200 (DeepSeek-V3 block,
96 experts top-8, 2026-12-02): every token on the same few experts by step 5 (expert maxvio 10 of 11)
and still 9 at step 40.

What: around each optimizer step, the component of every router row along the unit mean input u of
the step's tokens (all micro-batches, summed over the world: the same u on every rank) is restored,
    c_E = W_ED u_D before the step;  W_ED += outer(c_E - W_ED u_D, u_D) after it,
so a step changes how the router tells tokens apart (any direction orthogonal to u) but not how much it
likes an expert on average; that is what the score-correction bias is for. The forward is unchanged
(the same weights, checkpoints and exports as DeepSeek-V3's router); the cost is a [L, D] all_reduce
and two [E, D] x [D] products per step. Works on FSDP shards (rows of W) and plain masters alike.

Rejected: a faster bias (0.01-0.03 per step: maxvio 3-5 at step 20 on the H200), a sequence aux loss
(1e-2 / 3e-2: 6.5 / 4.7), a 10x smaller router learning rate (slower drift, same direction).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moontrain.model.router import Router


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class MeanFreeRouterUpdates:
    def __init__(self, routers: list[Router], group: dist.ProcessGroup | None) -> None:
        """routers: every router that has mean_free_updates on; group: the world (None: one process)."""
        self.routers, self.group = routers, group

    @contextmanager
    @torch.no_grad()
    def held(self) -> Iterator[None]:
        """Collective (one all_reduce): the optimizer step inside leaves each router's weights along its
        mean input unchanged. Clears the input sums for the next step."""
        if not self.routers:
            yield
            return
        sum_LD = torch.stack([r.input_sum_D for r in self.routers])
        if self.group is not None:
            dist.all_reduce(sum_LD, group=self.group)
        u_LD = sum_LD / sum_LD.norm(dim=1, keepdim=True).clamp_min(1e-30)  # no tokens: u = 0, a no-op
        weights = [_local(r.weight) for r in self.routers]
        c_before = [w @ u_D for w, u_D in zip(weights, u_LD, strict=True)]
        yield
        for w, u_D, c_E in zip(weights, u_LD, c_before, strict=True):
            w.add_(torch.outer(c_E - w @ u_D, u_D))
        for r in self.routers:
            r.input_sum_D.zero_()
