"""Muon and QK-Clip: Newton-Schulz against its exact polynomial, owner balance, the experts' merged gate_up
master stepped bitwise as separate W_gate and W_up masters (one process and 2 expert-data-parallel replicas),
sharded == a single-process Muon written here (EP = 1, 2, 4 and 2 replicas x EP 2, FSDP on, per-head Q/K/V
on, QK-Clip clipping), bitwise resume and resharding of the Muon state, QK-Clip holding the max logit at tau,
config errors.

Tolerances: Newton-Schulz runs in bf16, so a sharded run cannot be bitwise equal to a reference whose
fp32 grads were summed in another order: one flipped bf16 rounding of NS's input moves its output by
bf16 noise. As in test_ep_equality the reference is run twice, once with the global batch rows
reversed (same loss, another fp32 summation order), and the difference of the two references -- which
went through bf16 Newton-Schulz like the sharded run -- times 20 is the tolerance (floor 1e-5 relative).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moontrain.checkpoint import CheckpointError, find_latest
from moontrain.config import RunConfig
from moontrain.model.attention import MLAttention
from moontrain.model.config import ModelConfig
from moontrain.model.max_logit import causal_max_logit
from moontrain.optim.config import OptimConfig
from moontrain.optim.muon import NS_COEFFS, Muon, assign_owners, newton_schulz
from moontrain.optim.qk_clip import QKClip
from moontrain.parallel.layout import build_layout, single_process_layout
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config, train
from tests.moontrain.parallel.test_ep_equality import (
    _capture_first_grads,
    _full_state,
    _reverse_rows,
    _skew,
    tiny_config,
)

CPU = torch.device("cpu")
LR_GROWTH = 0.02  # Muon lr that makes the tiny model's attention logits grow ~25x in 30 steps
TAU = 0.04  # below the tiny model's initial max logit (~0.05): QK-Clip clips from the first step


# ------------------------------------------------------------------------------------------ Newton-Schulz
def _ns_polynomial_fp64(G: torch.Tensor, steps: int) -> torch.Tensor:
    """What the quintic iteration computes in exact arithmetic: the polynomial applied `steps` times to
    the singular values of G / ||G||_F, with G's singular vectors."""
    U, s, Vh = torch.linalg.svd(G.double() / G.double().norm(), full_matrices=False)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag(s) @ Vh


# bf16 unit roundoff 2^-8 per rounding, ~3 roundings per iteration (A, B, X), 5 iterations, entries of X
# bounded by its spectral norm (<= 1.25 after the first iteration)
NS_TOL = 15 * 2.0**-8 * 1.25


def check_newton_schulz(shape: tuple[int, int], device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(3, *shape, generator=gen)
    got = newton_schulz(G.to(device), 5).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == G.shape
    for i in range(3):
        want = _ns_polynomial_fp64(G[i], 5)
        diff = (got[i].double() - want).abs().max().item()
        assert diff <= NS_TOL, f"matrix {i}: max |NS - polynomial| {diff:.3g} > {NS_TOL:.3g}"
    # the iteration drives every singular value into the quintic's band around 1 (K. Jordan's coefficients)
    sv = torch.linalg.svdvals(got.double())
    assert sv.min() > 0.6 and sv.max() < 1.25, sv


@pytest.mark.parametrize("shape", [(24, 64), (96, 32), (48, 48)])
def test_newton_schulz_matches_its_polynomial(shape: tuple[int, int]) -> None:
    check_newton_schulz(shape, "cpu")


def test_owner_assignment_balances_cost() -> None:
    gen = torch.Generator().manual_seed(1)
    costs = torch.randint(1, 1000, (37,), generator=gen).tolist()
    for world in (1, 2, 3, 8):
        owners = assign_owners(costs, world)
        load = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
        # longest-processing-time bound: no rank exceeds the mean by more than the largest matrix
        assert max(load) <= sum(costs) / world + max(costs), (world, load)
        assert owners == assign_owners(costs, world)  # deterministic: every rank computes the same plan


# ------------------------------------------------------------------------------------------ experts' gate_up
EPN, HE, FE = 3, 24, 40  # 3 experts: 2 replicas hold chunks of 2 and 1


def _expert_muon_steps(rank: int, world: int, merged: bool) -> dict[str, torch.Tensor]:
    """Three Muon steps (Nesterov momentum, weight decay) of one layer's expert masters stored as gate_up
    [epn, H, 2F] with column blocks (F, F), or as separate gate and up [epn, H, F]; world > 1: replicas of the
    same rows and grads in the expert-data-parallel group. Returns the masters and momentum buffers as gate,
    up and down."""
    gen = torch.Generator().manual_seed(4)
    shapes = {"gate": (HE, FE), "up": (HE, FE), "down": (FE, HE)}
    init = {n: torch.randn(EPN, *s, generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(EPN, *s, generator=gen) for n, s in shapes.items()} for _ in range(3)]
    joined = lambda t: torch.cat([t["gate"], t["up"]], dim=2)
    names = ("gate_up", "down") if merged else ("gate", "up", "down")
    params = {n: torch.nn.Parameter(joined(init) if n == "gate_up" else init[n].clone()) for n in names}
    opt = Muon([{"params": list(params.values()), "kind": "experts", "name": "experts"}], lr=0.02, weight_decay=0.1,
               momentum=0.95, nesterov=True, ns_steps=5, betas=(0.9, 0.95), eps=1e-8, fused=False,
               column_blocks={id(params["gate_up"]): (FE, FE)} if merged else None,
               expert_group=dist.group.WORLD if world > 1 else None)
    for g in grads:
        for n, p in params.items():
            p.grad = joined(g) if n == "gate_up" else g[n].clone()
        opt.step()
    out = {}
    for n, p in params.items():
        for what, t in (("master", p.detach()), ("momentum", opt.state[p]["momentum_buffer"])):
            parts = dict(zip(("gate", "up"), t.split(FE, dim=2), strict=True)) if n == "gate_up" else {n: t}
            out.update({f"{what}.{k}": v.clone() for k, v in parts.items()})
    return out


def test_merged_gate_up_steps_as_separate_masters() -> None:
    """Each expert's W_gate and W_up columns are two [H, F] matrices, each with the [H, F] scale: the merged
    step equals the separate masters' bitwise (NS reads each half contiguous, the update is elementwise)."""
    torch.set_num_threads(1)
    assert_bitwise(_expert_muon_steps(0, 1, merged=True), _expert_muon_steps(0, 1, merged=False),
                   "gate_up vs separate gate, up")
    merged = run_ranks(_expert_muon_steps, 2, True)
    separate = run_ranks(_expert_muon_steps, 2, False)
    for rank in range(2):
        assert_bitwise(merged[rank], separate[rank], f"2 replicas, rank {rank}: gate_up vs separate gate, up")


# ------------------------------------------------------------------------------------------ reference Muon
def _reference_orthogonalize(M: torch.Tensor) -> torch.Tensor:
    """Quintic Newton-Schulz on one matrix, bf16, as in the Muon / Moonlight write-ups."""
    if M.shape[0] > M.shape[1]:
        return _reference_orthogonalize(M.T).T
    X = M.bfloat16()
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * (A @ A)) @ X
    return X


class ReferenceMuon(torch.optim.Optimizer):
    """Single-process Muon, one matrix at a time: experts one by one (gate_up's W_gate and W_up columns two
    matrices per expert), the query rows of each MLA head and
    the key and value rows of each head of wkv_b separately, every other linear weight whole; torch's
    AdamW for the head, the non-linear-map matrices (routers, KDA taps), embedding and norms."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig) -> None:
        mc = model.cfg
        linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        mla = {n for n, m in model.named_modules() if isinstance(m, MLAttention)}
        self.mats, decay, no_decay = [], [], []
        for name, p in model.named_parameters():
            module = name.rsplit(".", 2)[0]
            if name.endswith(".experts.master.gate_up"):
                self.mats.append((p, "gate_up"))
            elif ".experts.master." in name:
                self.mats.append((p, "experts"))
            elif p.ndim < 2 or "embed" in name:
                no_decay.append(p)
            elif name.startswith("lm_head") or id(p) not in linear:
                decay.append(p)
            elif module not in mla:
                self.mats.append((p, None))
            elif name.endswith("attn.wq_b.weight"):
                self.mats.append((p, [mc.qk_nope_head_dim + mc.qk_rope_head_dim] * mc.num_heads))
            elif name.endswith("attn.wkv_b.weight"):
                self.mats.append((p, [mc.qk_nope_head_dim, mc.v_head_dim] * mc.num_heads))
            else:
                self.mats.append((p, None))
        super().__init__([p for p, _ in self.mats] + decay + no_decay, {"lr": cfg.lr})
        self.cfg = cfg
        self.adamw = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}],
                                       lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        self.bufs = {id(p): torch.zeros_like(p) for p, _ in self.mats}

    folds_clip = False  # the training step's optimizer contract (moontrain/optim/protocol.py)
    skips_on_device = False
    written_back = frozenset()

    def clip_next_step(self, factor: torch.Tensor) -> None:
        raise AssertionError("folds_clip is False")

    def skip_next_step_if(self, found_inf: torch.Tensor) -> None:
        raise AssertionError("skips_on_device is False")

    @torch.no_grad()
    def step(self, closure=None):
        cfg, lr, mu = self.cfg, self.cfg.lr, self.cfg.muon_momentum
        for p, split in self.mats:
            buf = self.bufs[id(p)]
            buf.mul_(mu).add_((1 - mu) * p.grad)
            u = (1 - mu) * p.grad + mu * buf
            p.mul_(1 - lr * cfg.weight_decay)
            if split == "gate_up":
                F = p.shape[2] // 2
                blocks = [(p[e, :, c:c + F], u[e, :, c:c + F]) for e in range(p.shape[0]) for c in (0, F)]
            elif split == "experts":
                blocks = [(p[e], u[e]) for e in range(p.shape[0])]
            elif split is None:
                blocks = [(p, u)]
            else:
                blocks = list(zip(p.split(split), u.split(split), strict=True))
            for p_b, u_b in blocks:
                o = _reference_orthogonalize(u_b).float()
                p_b.sub_(lr * 0.2 * math.sqrt(max(u_b.shape)) * o)
        self.adamw.step()


# ------------------------------------------------------------------------------------------ sharded == reference
def _muon_config(backend: str, ep: int) -> RunConfig:
    cfg = tiny_config(backend, ep)
    # AdamW's eps raised from 1e-8: the AdamW-stepped parameters (embedding, head, norms, routers) must
    # respond continuously to their grads. With eps ~0 an element whose grad is ~0 moves by +-lr on its
    # first step whatever its size, so the bf16 noise that Muon's updates put into the step-2 grads
    # would flip such elements by 2 lr: a real difference of the reduction order, not of sharding
    # all-MLA: TAU is set for the softmax layers' logits (QK-Clip has nothing to do in KDA layers)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon", muon_per_head_qkv=True,
                                                              qk_clip_tau=TAU, eps=1e-3),
                               model=dataclasses.replace(cfg.model, kda_layers_per_mla=0))


def _train_and_gather(trainer: Trainer) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    _skew(trainer)
    first_grads: dict[str, torch.Tensor] = {}
    _capture_first_grads(trainer, first_grads)
    stats = trainer.fit()
    clipped = stats[-1].scalars["qk/clipped_heads/total"]
    return [x for s in stats for x in (s.loss, s.grad_norm)], clipped, {**_full_state(trainer), **first_grads}


def _reference_run(reverse: bool):
    torch.set_num_threads(1)
    trainer = Trainer(_muon_config("local", 1), single_process_layout(CPU))
    trainer.optimizer = ReferenceMuon(trainer.model, trainer.cfg.optim)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    if reverse:
        _reverse_rows(trainer)
    return _train_and_gather(trainer)


def _sharded_run(rank: int, world: int, backend: str, ep: int):
    trainer = Trainer(_muon_config(backend, ep), build_layout(ep, CPU))
    assert trainer.fsdp and type(trainer.optimizer).__name__ == "Muon"
    result = _train_and_gather(trainer)
    trainer.close()
    return result


@pytest.fixture(scope="module")
def muon_reference():
    losses, clipped, state = _reference_run(reverse=False)
    losses_r, _, state_r = _reference_run(reverse=True)
    assert clipped > 0, "tau should make QK-Clip clip heads in the reference"
    # floor: the first Muon step's update comes out of bf16 Newton-Schulz (2^-8 relative per element); a
    # reordered fp32 input moves some of those roundings, which reach the step-2 loss and grad norm at a few
    # 1e-5 relative on CPUs whose GEMM kernels differ by shape (AVX-512: 2.4e-5 measured); 1e-4 leaves room
    loss_tol = [max(20 * abs(a - b), 1e-4 * abs(a)) for a, b in zip(losses, losses_r, strict=True)]
    tol = {k: max(20 * (state[k] - state_r[k]).abs().max().item(), 1e-5 * state[k].abs().max().item(), 1e-9)
           for k in state}
    return losses, clipped, state, loss_tol, tol


@pytest.mark.parametrize(("world", "backend", "ep"),
                         [(2, "alltoall", 1), (2, "alltoall", 2), (4, "alltoall", 4), (4, "moonep", 2)],
                         ids=["fsdp2-ep1", "ep2", "ep4", "dp2xep2-moonep"])
def test_sharded_muon_matches_single_process_reference(muon_reference, world: int, backend: str, ep: int) -> None:
    losses, clipped, state, loss_tol, tol = muon_reference
    got_losses, got_clipped, got_state = run_ranks(_sharded_run, world, backend, ep, timeout_s=400)[0]
    for i, (a, b) in enumerate(zip(got_losses, losses, strict=True)):
        assert abs(a - b) <= loss_tol[i], f"step {i // 2} {('loss', 'grad norm')[i % 2]}: {a} vs {b}"
    assert got_clipped == clipped, "QK-Clip clipped other heads than the reference"
    assert got_state.keys() == state.keys()
    for name, ref in state.items():
        diff = (got_state[name] - ref).abs().max().item()
        assert diff <= tol[name], f"{name}: max |diff| {diff:.3g} > tol {tol[name]:.3g}"


# ------------------------------------------------------------------------------------------ checkpoints
def _muon_small(backend: str, ep: int, run_dir: str, **kw) -> RunConfig:
    cfg = small_config(backend, ep, run_dir=run_dir, **kw)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon", qk_clip_tau=TAU))


def _straight_then_save(rank: int, world: int, run_dir: str):
    cfg = _muon_small("moonep", 2, run_dir)
    straight = Trainer(cfg, build_layout(2, CPU))
    losses = train(straight, 4)
    state = full_state(straight)
    straight.close()
    first = Trainer(cfg, build_layout(2, CPU))
    first_losses = train(first, 2)
    first.save_checkpoint()
    first.close()
    return losses, state, first_losses


def _resume(rank: int, world: int, run_dir: str):
    trainer = Trainer(_muon_small("moonep", 2, run_dir), build_layout(2, CPU))
    trainer.load_checkpoint(find_latest(Path(run_dir) / "checkpoints"))
    loaded = full_state(trainer)
    losses = train(trainer, 2)
    state = full_state(trainer)
    trainer.close()
    return loaded, losses, state


def test_muon_resume_is_bitwise_and_reshards(tmp_path: Path) -> None:
    """EP=2 + FSDP: 4 steps straight == 2 steps, save, resume in new processes, 2 steps (bitwise: momentum
    buffers, AdamW moments, parameters, router biases); the EP=2 checkpoint loads bitwise in one process."""
    straight_losses, straight_state, first_losses = run_ranks(_straight_then_save, 2, str(tmp_path), timeout_s=400)[0]
    assert any(k.endswith(".momentum_buffer") for k in straight_state)
    assert any(".experts.master." in k and k.endswith(".momentum_buffer") for k in straight_state)
    loaded, rest_losses, state = run_ranks(_resume, 2, str(tmp_path), timeout_s=400)[0]
    assert first_losses + rest_losses == straight_losses, (first_losses, rest_losses, straight_losses)
    assert_bitwise(state, straight_state, "4 steps vs 2 + resume + 2")
    single = Trainer(_muon_small("local", 1, str(tmp_path / "one")), single_process_layout(CPU))
    single.load_checkpoint(find_latest(tmp_path / "checkpoints"))
    assert_bitwise(full_state(single), loaded, "Muon state EP=2 -> 1 process")


def test_checkpoint_of_another_optimizer_is_refused(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    adamw = Trainer(small_config("local", 1, run_dir=str(tmp_path)), single_process_layout(CPU))
    train(adamw, 1)
    adamw.save_checkpoint()
    muon = Trainer(_muon_small("local", 1, str(tmp_path)), single_process_layout(CPU))
    with pytest.raises(CheckpointError, match=r"another optim\.name"):
        muon.load_checkpoint(find_latest(tmp_path / "checkpoints"))


# ------------------------------------------------------------------------------------------ QK-Clip
def _attention(seed: int) -> MLAttention:
    cfg = ModelConfig(vocab_size=16, hidden_size=32, num_layers=1, dense_intermediate_size=32, num_heads=3,
                      q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                      num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64)
    torch.manual_seed(seed)
    attn = MLAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn


def _head_logits(attn: MLAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every causal logit of every head, [N, B*T*(T+1)/2], recomputed from the weights (no measurement)."""
    captured = {}

    def capture(q, k, v, **kw):
        captured["q"], captured["k"], captured["scale"] = q, k, kw["scale"]
        return torch.zeros_like(v)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = capture
    try:
        with torch.no_grad():
            attn(x, cos, sin)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    s = captured["q"] @ captured["k"].transpose(-1, -2) * captured["scale"]
    T = s.shape[-1]
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return s[:, :, keep].transpose(0, 1).reshape(s.shape[1], -1)


def test_qk_clip_scales_each_head_logit_by_gamma() -> None:
    from moontrain.model.rope import rope_cos_sin

    attn = _attention(0)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(7, 4, 10000.0, CPU)
    before = _head_logits(attn, x, cos, sin)
    clip = QKClip([attn], tau=1.0, group=None, layer_ids=[0])
    with torch.no_grad():
        attn(x, cos, sin)
    measured = attn.max_logit_N.clone()
    torch.testing.assert_close(measured, before.amax(dim=1), rtol=1e-6, atol=1e-6)  # the measurement is exact
    tau = float(measured.sort().values[1])  # between the heads: one head stays, the others are clipped
    clip.tau = tau
    clip.step()
    assert torch.isinf(attn.max_logit_N).all()  # the measurement restarts
    after = _head_logits(attn, x, cos, sin)
    gamma = torch.where(measured > tau, tau / measured, torch.ones_like(measured))
    assert (gamma < 1).sum() >= 1 and (gamma == 1).sum() >= 1
    torch.testing.assert_close(after, before * gamma[:, None], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after.amax(dim=1), torch.minimum(measured, torch.tensor(tau)), rtol=1e-5, atol=1e-6)


def test_causal_max_logit_chunks_match_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import moontrain.model.max_logit as max_logit

    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 11, 5, generator=gen), torch.randn(2, 3, 11, 5, generator=gen)
    whole = causal_max_logit(q, k, 0.5)
    monkeypatch.setattr(max_logit, "_SCORES_PER_CHUNK", 2 * 3 * 11 * 2)  # 2 query rows per chunk
    # the same dot products, but a GEMM of another shape may take another CPU kernel (FMA order): D = 5
    # products summed in fp32 differ by at most a few ulp of the largest logit
    tol = dict(rtol=8 * torch.finfo(torch.float32).eps, atol=8 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(causal_max_logit(q, k, 0.5), whole, **tol)
    s = (q @ k.transpose(-1, -2)).masked_fill(torch.triu(torch.ones(11, 11, dtype=torch.bool), 1), -math.inf)
    torch.testing.assert_close(whole, s.amax(dim=(0, 2, 3)) * 0.5, **tol)
    # packed documents: only logits inside a query's own document count
    doc_BT = torch.tensor([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2])
    other_B1TT = (doc_BT[:, :, None] != doc_BT[:, None, :]).unsqueeze(1)
    s_docs = s.masked_fill(other_B1TT, -math.inf)
    want = s_docs.amax(dim=(0, 2, 3)) * 0.5
    torch.testing.assert_close(causal_max_logit(q, k, 0.5, doc_BT), want, **tol)
    assert (want < whole).any()  # the documents hide some of the largest logits here


def _growth_run(tau: float, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step and head: the max logit of the step's forward, and (clip on) that of the updated weights
    before the clip on the same batch; the attention logits forced to grow (high lr, the same batch every step). QK-
    Clip on with tau > 0, measurement only with tau = 0."""
    torch.set_num_threads(1)
    cfg = tiny_config("local", 1)
    # router biases fixed: the next forward then sees exactly the weights the extra forward measured
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon", lr=LR_GROWTH, qk_clip_tau=1.0),
                              train=dataclasses.replace(cfg.train, steps=steps),
                              model=dataclasses.replace(cfg.model, router_bias_update_rate=0.0))
    trainer = Trainer(cfg, single_process_layout(CPU))
    batch = trainer.data.batch(0)
    trainer.data.batch = lambda step: batch
    clip = trainer.qk_clip
    clip.tau = tau if tau > 0 else math.inf
    maxima, updated = [], []
    clip_step = clip.step

    def measured_step() -> torch.Tensor:
        if tau > 0:  # an extra no-grad forward at the updated weights (its router counts discarded)
            seen = [a.max_logit_N.clone() for a in clip.attns]
            counts = [m.router.tokens_per_expert_E.clone() for m in trainer.model.moe_layers()]
            for a in clip.attns:
                a.max_logit_N.fill_(-math.inf)
            for moe in trainer.model.moe_layers():  # the updated experts (finish_step repeats this copy)
                moe.experts.push_master()
            with torch.no_grad():
                trainer.model(*batch)
            updated.append(torch.cat([a.max_logit_N.clone() for a in clip.attns]))
            for a, m in zip(clip.attns, seen, strict=True):
                a.max_logit_N.copy_(m)
            for moe, c in zip(trainer.model.moe_layers(), counts, strict=True):
                moe.router.tokens_per_expert_E.copy_(c)
        max_LN = clip_step()
        maxima.append(max_LN.flatten().clone())
        return max_LN

    clip.step = measured_step
    for _ in range(steps):
        trainer.train_step()
    return maxima, updated


def test_qk_clip_holds_max_logit_at_tau() -> None:
    """The clip rescales the weights after the step's update by the maxima of the step's forward (Kimi
    K2's order): every logit of a clipped head is scaled by tau / S_k, so the next forward's max logit
    is tau times that update's growth S(W_k + dW) / S_k, measured here by an extra forward (one bf16-free
    fp32 rounding apart)."""
    steps = 30
    free_heads, _ = _growth_run(0.0, steps)
    free = [float(m.max()) for m in free_heads]
    tau = 3 * free[0]
    assert free[-1] > 4 * tau, f"the logits should grow without QK-Clip: {free}"
    clipped_heads, updated = _growth_run(tau, steps)
    for k in range(steps - 1):  # per head: the next forward sees exactly gamma * the updated weights' logits
        gamma = torch.where(clipped_heads[k] > tau, tau / clipped_heads[k], 1.0)
        torch.testing.assert_close(clipped_heads[k + 1], gamma * updated[k], rtol=1e-5, atol=0)
    clipped = [float(m.max()) for m in clipped_heads]
    growth = max(float((u / m).max()) for u, m in zip(updated, clipped_heads, strict=True))
    assert max(clipped) <= tau * growth * (1 + 1e-5), (clipped, tau, growth)  # one update's overshoot at most
    assert max(clipped) < free[-1] / 3, (clipped, free)
    assert min(clipped[-10:]) >= tau, clipped  # held at tau, not below it: heads clip to tau, not further


def test_muon_groups_on_the_hybrid_stack() -> None:
    """Muon takes the linear maps (MLA, KDA, FFN, latent projections) and the experts; AdamW the head,
    the routers, KDA's convolution taps and everything 1-D; QK-Clip measures the MLA layers only."""
    cfg = tiny_config("local", 1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=2, kda_layers_per_mla=1,
                                                             kda_head_dim=16),
                              optim=dataclasses.replace(cfg.optim, name="muon", qk_clip_tau=1.0))
    torch.set_num_threads(1)
    trainer = Trainer(cfg, single_process_layout(CPU))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in trainer.optimizer.param_groups}
    kda = [i for i, b in enumerate(trainer.model.layers) if b.is_kda]
    assert kda and len(kda) < len(trainer.model.layers)
    assert f"layers.{kda[0]}.attn.q_proj.weight" in groups["muon"]
    assert f"layers.{kda[0]}.attn.q_conv1d" in groups["adamw"]
    assert "lm_head.weight" in groups["adamw"] and "layers.1.ffn.router.weight" in groups["adamw"]
    assert all(".experts.master." in n for n in groups["experts"]) and len(groups["experts"]) == 4
    assert trainer.optimizer.column_blocks == {id(moe.experts.master["gate_up"]): (moe.experts.intermediate,) * 2
                                               for moe in trainer.model.moe_layers()}
    want_muon = sorted(n for n, m in trainer.model.named_modules() if isinstance(m, torch.nn.Linear)
                       and n != "lm_head")
    assert groups["muon"] == sorted(n + ".weight" for n in want_muon)
    assert trainer.qk_clip.layer_ids == [i for i in range(2) if i not in kda]


# ------------------------------------------------------------------------------------------ config
def test_optim_config_errors() -> None:
    with pytest.raises(ValueError, match=r"optim\.name must be 'adamw' or 'muon', got 'sgd'"):
        OptimConfig(name="sgd")
    with pytest.raises(ValueError, match=r"optim\.write_back=true is the fused AdamW"):
        OptimConfig(name="muon", write_back=True)
    with pytest.raises(ValueError, match=r"optim\.qk_clip_tau must be a finite number >= 0"):
        OptimConfig(qk_clip_tau=-1.0)
    with pytest.raises(ValueError, match=r"optim\.muon_momentum must be in"):
        OptimConfig(muon_momentum=1.0)
