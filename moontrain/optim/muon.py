"""Muon for the matrix parameters, AdamW for the rest: the optimizer half of MuonClip (QK-Clip: qk_clip.py).

Legend: n rows (output features) and m columns of a dense matrix, W ranks of the FSDP mesh, epn local
experts, Hin/Hout an expert projection's widths, F the experts' width, P matrices batched through one NS call.

Groups (`split_muon_groups`): muon (the nn.Linear weights: attention, dense FFN, shared experts, MoE latent
projections); experts (the fp32 expert masters [epn, Hin, Hout], one matrix per expert and column block:
gate_up [epn, H, 2F] is W_gate and W_up, two [H, F] matrices an expert, ExpertWeights.column_blocks); adamw
(the output head and matrices that are not linear maps: router weights, KDA's convolution taps; decayed);
no_decay (norms, biases, the token embedding: AdamW, not decayed).

Muon step per matrix G (its grad), momentum mu, Nesterov:
    buf = lerp(buf, G, 1 - mu);   U = lerp(G, buf, mu)
    O = NS5(U)   (quintic Newton-Schulz, bf16, coefficients (3.4445, -4.7750, 2.0315), 5 iterations,
                  after normalising U by its Frobenius norm: O ~ the orthogonal polar factor of U)
    p = p * (1 - lr * wd) - lr * 0.2 * sqrt(max(rows, cols)) * O
The factor 0.2 * sqrt(max(rows, cols)) gives the update the RMS of a typical AdamW update (Moonlight),
so optim.lr and optim.weight_decay carry over from AdamW. With optim.muon_per_head_qkv the query rows of
each head and the key and value rows of each head of wkv_b are separate matrices (per-head Muon, K3).

Distribution, no matrix orthogonalised twice:
- FSDP2 dense shards (DTensor, Shard(0) over the world): each matrix has one owner rank; owners are
  assigned once by longest-processing-time greedy on the Newton-Schulz cost (rows * cols * min), so
  the ranks' loads differ by at most one matrix. One all_to_all sends every rank's rows of U (bf16, the
  dtype Newton-Schulz reads) to the owners, the owners run NS batched over same-shaped matrices, and a
  second all_to_all returns each rank its rows of O (bf16, exactly NS's output). The rescale and the
  update are applied to the local rows in fp32. Without FSDP (replicated dense parameters) every rank
  computes every matrix (identical inputs, no communication).
- expert masters: local to their EP rank, so NS runs batched over the epn local experts without
  communication. Expert-data-parallel replicas hold the same rows and grads: replica r orthogonalises
  the r-th chunk of the experts and one all_gather over the replica group (bf16) shares the results.
- AdamW groups: torch's functional AdamW (fused on the GPU), with torch's state names.

State per Muon parameter: `momentum_buffer` (fp32, the parameter's shape and sharding); per AdamW parameter
torch's `step`, `exp_avg`, `exp_avg_sq`. Checkpoints store them under optim.<parameter>.<state name> like
AdamW's (moontrain.checkpoint): resume is bitwise and the EP / DP degree may change between save and load.
The expert masters are written by this step only: ExpertWeights.finish_step refreshes their compute rows.

Rejected: gathering every full matrix on every rank (W-fold repeated NS and W-fold traffic); Dion's
low-rank power iteration (a different optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_step

from moontrain.collectives import all_gather_single
from moontrain.optim.config import OptimConfig
from moontrain.optim.schedule import lr_multiplier

NS_COEFFS = (3.4445, -4.7750, 2.0315)
_NS_EPS = 1e-7


def newton_schulz(G_PNM: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximate orthogonal polar factor of each matrix of a batch [P, n, m] (or one [n, m]), in bf16."""
    a, b, c = NS_COEFFS
    X = G_PNM.to(torch.bfloat16)
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # iterate on the short side: X X^T is min(n, m) square
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + _NS_EPS)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


def _orthogonalize_columns(u: torch.Tensor, widths: tuple[int, ...], steps: int) -> list[torch.Tensor]:
    """NS of each expert's column blocks of u [epn, Hin, Hout] (widths sum to Hout), batched over the experts:
    one [epn, Hin, w] bf16 result per block. A block is made contiguous first, so its NS is the one of the
    same matrices stored alone."""
    if len(widths) == 1:
        return [newton_schulz(u, steps)]
    return [newton_schulz(b.to(torch.bfloat16, memory_format=torch.contiguous_format), steps)
            for b in u.split(widths, dim=2)]


def rms_scale(rows: int, cols: int) -> float:
    """Moonlight's factor: an orthogonal update times this has the RMS of a typical AdamW update."""
    return 0.2 * math.sqrt(max(rows, cols))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, rows) of `rank` under torch.chunk(n, world): FSDP2's Shard(0) split."""
    chunk = -(-n // world) if n else 0
    offset = min(rank * chunk, n)
    return offset, min(chunk, n - offset)


def split_muon_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Muon for the weights of the nn.Linear layers but the output head, and the expert masters; AdamW for
    the rest (router weights, KDA's convolution taps and gate biases, ...; norms, biases, embedding
    undecayed as in adamw.split_param_groups)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    groups: dict[str, list[nn.Parameter]] = {"muon": [], "experts": [], "adamw": [], "no_decay": []}
    for name, p in model.named_parameters():
        if ".experts.master." in name:
            groups["experts"].append(p)
        elif p.ndim < 2 or name.endswith(".bias") or "embed" in name:
            groups["no_decay"].append(p)
        elif id(p) in linear and not name.startswith("lm_head."):
            groups["muon"].append(p)
        else:
            groups["adamw"].append(p)
    return groups


def qkv_row_blocks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Per-head Muon: parameter name -> the row sizes of its per-head matrices, from every layer that
    declares them (`head_row_blocks()`: the MLA layers; KDA's wq is not split per head)."""
    return _declared_blocks(model, "head_row_blocks")


def expert_column_blocks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Expert masters: parameter name -> the column widths of the separate matrices in each expert, from
    every module that declares them (`column_blocks()`: ExpertWeights, whose gate_up is W_gate and W_up)."""
    return _declared_blocks(model, "column_blocks")


def _declared_blocks(model: nn.Module, method: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for module_name, module in model.named_modules():
        declared = getattr(module, method, None)
        if declared is None:
            continue
        for name, blocks in declared().items():
            out[f"{module_name}.{name}"] = blocks
    return out


@dataclass(frozen=True, slots=True)
class _Matrix:
    """One dense Muon parameter as the step sees it."""

    rows: int
    cols: int
    blocks: tuple[int, ...]  # row sizes of its separately orthogonalised matrices
    owner: int  # the rank that orthogonalises it (0 when not sharded)

    @property
    def cost(self) -> int:
        return sum(r * self.cols * min(r, self.cols) for r in self.blocks)


def assign_owners(costs: list[int], world: int) -> list[int]:
    """Longest processing time first: the costliest matrix goes to the least loaded rank (ties: the
    lowest rank, then the earliest matrix), so every rank computes the same assignment."""
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


class Muon(torch.optim.Optimizer):
    """Muon (see the module docstring) for groups with kind 'muon' or 'experts', AdamW for kind 'adamw'.

    row_blocks: id(parameter) -> row sizes of its separate matrices (per-head Muon), others whole.
    column_blocks: id(expert master) -> column widths of the separate matrices in each expert (gate_up: F, F),
    others one matrix per expert.
    expert_group: the expert-data-parallel group (replicas of the same expert rows), or None."""

    def __init__(self, param_groups: list[dict], *, lr: float, weight_decay: float, momentum: float,
                 nesterov: bool, ns_steps: int, betas: tuple[float, float], eps: float, fused: bool,
                 row_blocks: dict[int, tuple[int, ...]] | None = None,
                 column_blocks: dict[int, tuple[int, ...]] | None = None,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        for g in param_groups:
            if g.get("kind") not in ("muon", "experts", "adamw"):
                raise ValueError(f"Muon param group {g.get('name')!r} has kind {g.get('kind')!r}; "
                                 "use 'muon', 'experts' or 'adamw'")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, betas=betas, eps=eps, fused=fused)
        super().__init__(param_groups, defaults)
        self.row_blocks = dict(row_blocks or {})
        self.column_blocks = dict(column_blocks or {})
        self.expert_group = expert_group
        self._plans: dict[tuple[int, ...], list[_Matrix]] = {}
        self._row_scales: dict[int, torch.Tensor] = {}

    # the training step's optimizer contract (moontrain/optim/protocol.py): the clip scales the grads in
    # place before step() (Newton-Schulz normalises the Muon update anyway; the AdamW groups need it)
    @property
    def folds_clip(self) -> bool:
        return False

    def clip_next_step(self, factor: torch.Tensor) -> None:
        raise ValueError("Muon does not fold the gradient clip into its step (folds_clip is False): scale the "
                         "grads before step()")

    @property
    def skips_on_device(self) -> bool:
        return False

    def skip_next_step_if(self, found_inf: torch.Tensor) -> None:
        raise ValueError("Muon cannot skip a step on a device flag (skips_on_device is False): read the step's "
                         "verdict on the host and do not call step()")

    @property
    def written_back(self) -> frozenset[int]:
        return frozenset()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["kind"] == "adamw":
                self._adamw(group, params)
                continue
            if group["kind"] == "muon":
                self._dense(group, params, self._momentum(group, params))
            else:
                self._experts(group, params)
        return None

    # --------------------------------------------------------------------------------------- Muon
    def _momentum(self, group: dict, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Updates the momentum buffers; returns the directions (local rows, fp32). Nesterov's direction
        is written over the grads (no temporary: the grads are spent after this step)."""
        mu = group["momentum"]
        grads = [_local(p.grad) for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(_local(state["momentum_buffer"]))
        torch._foreach_lerp_(bufs, grads, 1.0 - mu)
        if not group["nesterov"]:
            return bufs
        torch._foreach_lerp_(grads, bufs, mu)
        return grads

    def _apply(self, group: dict, locals_: list[torch.Tensor], orth: list[torch.Tensor],
               scales: list[torch.Tensor | float]) -> None:
        """p = p * (1 - lr * wd) - lr * scale * O, on the local rows in fp32."""
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            torch._foreach_mul_(locals_, 1.0 - lr * wd)
        for p, o, scale in zip(locals_, orth, scales, strict=True):
            if isinstance(scale, float):
                p.add_(o, alpha=-lr * scale)  # mixed dtypes: bf16 o is read as fp32, no temporary
            else:
                p.add_(o.to(p.dtype) * scale, alpha=-lr)

    def _dense(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        sharded = isinstance(params[0], DTensor)
        if any(isinstance(p, DTensor) != sharded for p in params):
            raise ValueError("Muon: a 'muon' group mixes FSDP-sharded and plain parameters; shard all or none")
        mesh_group = params[0].device_mesh.get_group() if sharded else None
        world = dist.get_world_size(mesh_group) if sharded else 1
        rank = dist.get_rank(mesh_group) if sharded else 0
        plan = self._plan(params, world)
        if world == 1:
            orth = self._orthogonalize(updates, plan, group["ns_steps"])
        else:
            orth = self._orthogonalize_sharded(updates, plan, group["ns_steps"], mesh_group, world, rank)
        scales = [self._row_scale(p, m, world, rank) for p, m in zip(params, plan, strict=True)]
        self._apply(group, [_local(p) for p in params], orth, scales)

    def _plan(self, params: list[torch.Tensor], world: int) -> list[_Matrix]:
        key = tuple(id(p) for p in params)
        if key not in self._plans:
            shapes = [(p.shape[0], math.prod(p.shape[1:])) for p in params]
            blocks = [self.row_blocks.get(id(p), (n,)) for p, (n, _) in zip(params, shapes, strict=True)]
            for p, (n, _), b in zip(params, shapes, blocks, strict=True):
                assert sum(b) == n, (tuple(p.shape), b)
            mats = [_Matrix(rows=n, cols=m, blocks=b, owner=0) for (n, m), b in zip(shapes, blocks, strict=True)]
            owners = assign_owners([mat.cost for mat in mats], world)
            self._plans[key] = [_Matrix(rows=mat.rows, cols=mat.cols, blocks=mat.blocks, owner=o)
                                for mat, o in zip(mats, owners, strict=True)]
        return self._plans[key]

    def _row_scale(self, p: torch.Tensor, mat: _Matrix, world: int, rank: int) -> torch.Tensor | float:
        """The RMS factor of each local row ([rows, 1]), or one float for a whole matrix."""
        if len(mat.blocks) == 1:
            return rms_scale(mat.rows, mat.cols)
        if id(p) not in self._row_scales:
            scale_n = torch.cat([torch.full((r,), rms_scale(r, mat.cols)) for r in mat.blocks])
            offset, rows = _rows_of(mat.rows, world, rank)
            self._row_scales[id(p)] = scale_n[offset:offset + rows, None].to(_local(p).device)
        return self._row_scales[id(p)]

    def _orthogonalize(self, full: list[torch.Tensor], plan: list[_Matrix], ns_steps: int) -> list[torch.Tensor]:
        """NS of each full matrix (split into its row blocks), batched over blocks of equal shape."""
        pieces = [u.reshape(mat.rows, mat.cols).split(mat.blocks) for u, mat in zip(full, plan, strict=True)]
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, blocks in enumerate(pieces):
            for j, b in enumerate(blocks):
                by_shape.setdefault(tuple(b.shape), []).append((i, j))
        out: list[list[torch.Tensor | None]] = [[None] * len(blocks) for blocks in pieces]
        for where in by_shape.values():
            o = newton_schulz(torch.stack([pieces[i][j] for i, j in where]), ns_steps)
            for (i, j), o_b in zip(where, o.unbind(0), strict=True):
                out[i][j] = o_b
        return [torch.cat(blocks).view(u.shape) if len(blocks) > 1 else blocks[0].view(u.shape)
                for blocks, u in zip(out, full, strict=True)]

    def _orthogonalize_sharded(self, updates: list[torch.Tensor], plan: list[_Matrix], ns_steps: int,
                               group: dist.ProcessGroup, world: int, rank: int) -> list[torch.Tensor]:
        """Owner compute: rows to the owners (all_to_all), NS there, rows back (all_to_all)."""
        rows_ri = [[_rows_of(mat.rows, world, r)[1] for mat in plan] for r in range(world)]
        mine = [i for i, mat in enumerate(plan) if mat.owner == rank]
        # to the owners: rank r's rows of each matrix owned by o, matrices in plan order
        send = [[updates[i].reshape(-1) for i, mat in enumerate(plan) if mat.owner == o] for o in range(world)]
        send_splits = [sum(t.numel() for t in ts) for ts in send]
        recv_splits = [sum(rows_ri[r][i] * plan[i].cols for i in mine) for r in range(world)]
        recv = self._all_to_all([t for ts in send for t in ts], send_splits, recv_splits, group,
                                updates[0].device)
        parts: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
        for r, chunk in enumerate(recv.split(recv_splits)):
            for i, t in zip(mine, chunk.split([rows_ri[r][i] * plan[i].cols for i in mine]), strict=True):
                parts[i].append(t.view(rows_ri[r][i], plan[i].cols))
        full = [torch.cat(parts[i]) for i in mine]
        orth = self._orthogonalize(full, [plan[i] for i in mine], ns_steps) if mine else []
        # back: each rank's rows of every matrix owned here
        back = []
        for r in range(world):
            offsets = [_rows_of(plan[i].rows, world, r) for i in mine]
            back += [o[off:off + n].reshape(-1) for o, (off, n) in zip(orth, offsets, strict=True)]
        got = self._all_to_all(back, recv_splits, send_splits, group, updates[0].device)
        out: list[torch.Tensor | None] = [None] * len(plan)
        for o, chunk in enumerate(got.split(send_splits)):
            owned = [i for i, mat in enumerate(plan) if mat.owner == o]
            for i, t in zip(owned, chunk.split([updates[i].numel() for i in owned]), strict=True):
                out[i] = t.view(updates[i].shape)
        return out

    @staticmethod
    def _all_to_all(pieces: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
                    group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        send = (torch.cat([t.to(torch.bfloat16) for t in pieces]) if pieces
                else torch.empty(0, dtype=torch.bfloat16, device=device))
        recv = torch.empty(sum(recv_splits), dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        return recv

    def _experts(self, group: dict, params: list[torch.Tensor]) -> None:
        """One master [epn, Hin, Hout] at a time (its temporaries are one master's, not all); each column
        block of an expert (column_blocks: gate_up's W_gate and W_up) is its own matrix with its own scale."""
        g = self.expert_group
        replicas = dist.get_world_size(g) if g is not None else 1
        me = dist.get_rank(g) if g is not None else 0
        for p in params:
            (u,) = self._momentum(group, [p])
            epn, Hin, Hout = u.shape
            widths = self.column_blocks.get(id(p), (Hout,))
            assert sum(widths) == Hout, (tuple(p.shape), widths)
            if replicas == 1:
                o = _orthogonalize_columns(u, widths, group["ns_steps"])
            else:
                per = -(-epn // replicas)  # experts per replica; the last chunks may be short or empty
                mine = u[min(me * per, epn):min((me + 1) * per, epn)]
                o_mine = torch.zeros(per, Hin, Hout, dtype=torch.bfloat16, device=u.device)
                if mine.shape[0]:
                    o_mine[:mine.shape[0]] = torch.cat(_orthogonalize_columns(mine, widths, group["ns_steps"]), 2)
                o_all = torch.empty(replicas * per, Hin, Hout, dtype=torch.bfloat16, device=u.device)
                all_gather_single(o_all, o_mine, group=g)
                o = o_all[:epn].split(widths, dim=2)
            self._apply(group, list(p.split(widths, dim=2)), list(o), [rms_scale(Hin, w) for w in widths])

    # -------------------------------------------------------------------------------------- AdamW
    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        fused = group["fused"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw_step(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, fused=fused or None,
                   amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=False)


def build_muon(model: nn.Module, cfg: OptimConfig, total_steps: int,
               expert_group: dist.ProcessGroup | None = None) -> tuple[Muon, torch.optim.lr_scheduler.LambdaLR]:
    groups = split_muon_groups(model)
    param_groups = [
        {"params": groups["muon"], "weight_decay": cfg.weight_decay, "name": "muon", "kind": "muon"},
        {"params": groups["experts"], "weight_decay": cfg.weight_decay, "name": "experts", "kind": "experts"},
        {"params": groups["adamw"], "weight_decay": cfg.weight_decay, "name": "adamw", "kind": "adamw"},
        {"params": groups["no_decay"], "weight_decay": 0.0, "name": "no_decay", "kind": "adamw"},
    ]
    param_groups = [g for g in param_groups if g["params"]]
    fused = cfg.fused
    if fused is None:
        fused = all(p.device.type == "cuda" for g in param_groups for p in g["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    per_head = qkv_row_blocks(model) if cfg.muon_per_head_qkv else {}
    row_blocks = {id(p): per_head[names[id(p)]] for p in groups["muon"] if names[id(p)] in per_head}
    columns = expert_column_blocks(model)
    column_blocks = {id(p): columns[names[id(p)]] for p in groups["experts"] if names[id(p)] in columns}
    opt = Muon(param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
               nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, betas=(cfg.beta1, cfg.beta2),
               eps=cfg.eps, fused=bool(fused), row_blocks=row_blocks, column_blocks=column_blocks,
               expert_group=expert_group)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_multiplier(step, cfg, total_steps))
    return opt, sched
