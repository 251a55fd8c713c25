"""parallel.dense=plain against FSDP2 at world size 1: the same training, bit for bit.

The K3 block (KDA, MLA, AttnRes, SiTU-GLU, latent MoE on moonep) in bf16 compute on the CPU (and once in
fp32, where nothing is cast), 2 accumulated passes per step, global-norm clipping and QK-Clip active, an
evaluation after every step, once with activation checkpointing: losses, grad norms, eval losses and every parameter, router bias and
optimizer state tensor equal after 3 steps, for AdamW and Muon. Checkpoints cross-load bitwise between the
two (world 1 both ways, and world 2 FSDP both ways), and training on from a loaded checkpoint stays equal.
A toy model pins the two effects of FSDP's module hooks on the values (input casts, one autograd node per
block's inputs). Each FSDP run needs a process group: spawned gloo ranks (tests/dist_utils.run_ranks).
The GPU test (train.compile, deterministic mode, NCCL) is the same comparison on one H200.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moontrain.checkpoint import find_latest
from moontrain.config import RunConfig, from_dict
from moontrain.config.eval_config import EvalConfig
from moontrain.dataclass_dict import to_dict
from moontrain.parallel import plain_dense
from moontrain.parallel.layout import build_layout
from moontrain.parallel.plain_dense import PlainDense
from moontrain.trainer.trainer import Trainer
from tests.dist_utils import run_ranks
from tests.moontrain.ckpt_utils import assert_bitwise, full_state, small_config

CPU = torch.device("cpu")
CORPUS = str(Path(__file__).resolve().parents[3] / "recipes" / "data" / "tiny_corpus.jsonl")


def _config(dense: str, run_dir: str, *, optim: str = "adamw", dtype: str = "bfloat16", fused: bool = False,
            recompute: bool = False, evaluate: bool = False) -> RunConfig:
    cfg = small_config("moonep", 1, run_dir=run_dir, k3_block=True)
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, dense=dense, compute_dtype=dtype),
        # grad_clip well under the grad norm (~4), QK-Clip's tau under the max logits (~0.05): both clip
        optim=dataclasses.replace(cfg.optim, name=optim, grad_clip=0.05, qk_clip_tau=0.03, fused=fused or None,
                                  write_back=False),
        train=dataclasses.replace(cfg.train, micro_batch_size=2, activation_checkpointing=recompute),
        eval=from_dict(EvalConfig, {"every": 1, "steps": 1, "data": {"path": CORPUS}} if evaluate else {}, "eval"),
    )


def _train(trainer: Trainer, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"loss": [], "grad_norm": [], "qk_clipped": [], "eval": []}
    for _ in range(steps):
        stats = trainer.train_step()
        out["loss"].append(stats.loss)
        out["grad_norm"].append(stats.grad_norm)
        out["qk_clipped"].append(stats.scalars["qk/clipped_heads/total"])
        out["eval"].append(stats.scalars.get("eval/loss"))
    return out


def _run(cfg: RunConfig) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    trainer = Trainer(cfg, build_layout(1, CPU))
    assert trainer.accumulation_steps == 2 and (trainer.plain_dense is None) == (cfg.parallel.dense == "fsdp")
    try:
        return _train(trainer, 3), full_state(trainer)
    finally:
        trainer.close()


def _plain_vs_fsdp(rank: int, world: int, run_dir: str, optim: str, dtype: str, fused: bool, recompute: bool
                   ) -> tuple:
    torch.set_num_threads(1)
    plain_dense.SCRATCH_BYTES = 4096  # the later passes' grads widened group by group: many groups here
    return tuple(_run(_config(dense, run_dir, optim=optim, dtype=dtype, fused=fused, recompute=recompute,
                              evaluate=True))
                 for dense in ("fsdp", "plain"))


@pytest.mark.parametrize("optim,dtype,fused,recompute", [("adamw", "bfloat16", True, False),
                                                         ("muon", "bfloat16", False, True),
                                                         ("adamw", "float32", False, False)])
def test_plain_equals_fsdp_at_world_1(tmp_path: Path, optim: str, dtype: str, fused: bool, recompute: bool) -> None:
    """fused: torch's fused AdamW (the GPU's; its write-back variant is the GPU test's). recompute:
    activation checkpointing (each block's forward runs again in backward, on the bf16 copies)."""
    (f_log, f_state), (p_log, p_state) = run_ranks(_plain_vs_fsdp, 1, str(tmp_path), optim, dtype, fused,
                                                   recompute)[0]
    assert sum(f_log["qk_clipped"]) > 0, f"QK-Clip must clip heads: {f_log}"
    assert min(f_log["grad_norm"]) > 0.05, f"clipping must be active (grad_clip 0.05): {f_log}"
    assert None not in f_log["eval"], f_log
    assert p_log == f_log, (p_log, f_log)
    assert_bitwise(p_state, f_state, f"plain vs fsdp ({optim}, {dtype})")


def test_scratch_groups_cover_every_tensor_in_order() -> None:
    assert plain_dense._scratch_groups([3, 4, 2, 9, 1, 1], 9) == [(0, 3), (3, 4), (4, 6)]
    assert plain_dense._scratch_groups([5], 5) == [(0, 1)]
    assert plain_dense._scratch_groups([], 5) == []


def _save_load_world_1(rank: int, world: int, run_dir: str) -> None:
    """Each of plain and fsdp saves after 2 steps; a trainer of the other kind that has trained 1 step of its
    own (so its bf16 copies are stale) loads it: the state is bitwise the saved one, and one more step on
    either side of the load gives the same state."""
    torch.set_num_threads(1)
    for saver, loader in (("plain", "fsdp"), ("fsdp", "plain")):
        root = Path(run_dir) / f"{saver}_to_{loader}"
        a = Trainer(_config(saver, str(root / "a")), build_layout(1, CPU))
        _train(a, 2)
        ckpt = a.save_checkpoint()
        saved = full_state(a)
        b = Trainer(_config(loader, str(root / "b")), build_layout(1, CPU))
        _train(b, 1)
        b.load_checkpoint(ckpt)
        assert_bitwise(full_state(b), saved, f"{saver} -> {loader} at world 1")
        a_log, b_log = _train(a, 1), _train(b, 1)
        assert b_log == a_log, (saver, loader, b_log, a_log)
        assert_bitwise(full_state(b), full_state(a), f"{saver} -> {loader}: the step after loading")
        a.close()
        b.close()


def test_checkpoints_cross_load_at_world_1(tmp_path: Path) -> None:
    run_ranks(_save_load_world_1, 1, str(tmp_path))


def _plain_save(rank: int, world: int, run_dir: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    trainer = Trainer(_config("plain", run_dir), build_layout(1, CPU))
    _train(trainer, 2)
    trainer.save_checkpoint()
    state = full_state(trainer)
    trainer.close()
    return state


def _fsdp2_load_and_save(rank: int, world: int, ckpt: str, run_dir: str) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    trainer = Trainer(_config("fsdp", run_dir), build_layout(1, CPU))
    trainer.load_checkpoint(ckpt)
    loaded = full_state(trainer)
    _train(trainer, 1)
    trainer.save_checkpoint()
    state = full_state(trainer)
    trainer.close()
    return loaded, state


def _plain_load(rank: int, world: int, ckpt: str, run_dir: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    trainer = Trainer(_config("plain", run_dir), build_layout(1, CPU))
    trainer.load_checkpoint(ckpt)
    state = full_state(trainer)
    trainer.close()
    return state


def test_checkpoints_cross_load_with_fsdp_at_world_2(tmp_path: Path) -> None:
    """plain (world 1) -> FSDP over 2 ranks -> plain: each load bitwise the saved state."""
    saved = run_ranks(_plain_save, 1, str(tmp_path / "a"))[0]
    loaded, state_2 = run_ranks(_fsdp2_load_and_save, 2, str(find_latest(tmp_path / "a" / "checkpoints")),
                                str(tmp_path / "b"))[0]
    assert_bitwise(loaded, saved, "plain at world 1 -> fsdp at world 2")
    reloaded = run_ranks(_plain_load, 1, str(find_latest(tmp_path / "b" / "checkpoints")), str(tmp_path / "c"))[0]
    assert_bitwise(reloaded, state_2, "fsdp at world 2 -> plain at world 1")


def test_plain_needs_world_1() -> None:
    cfg = _config("plain", "runs/test")
    with pytest.raises(ValueError, match=r"parallel.dense=plain .* world size 1 only, got 2 ranks; use "
                                         r"parallel.dense=auto \(the default: fsdp at more than one rank\), fsdp or "
                                         r"allreduce for 2 ranks"):
        cfg.check_world(2)
    cfg.check_world(1)
    with pytest.raises(ValueError, match=r"parallel\.dense"):
        from_dict(RunConfig, {**to_dict(cfg), "parallel": {**to_dict(cfg.parallel), "dense": "replicate"}})


def test_auto_is_plain_at_one_rank_under_a_process_group_else_fsdp() -> None:
    """parallel.dense=auto (the default): plain where FSDP would shard over one rank, fsdp at more ranks, and fsdp
    (the model as built) without a process group; an explicit mode is kept at every world size."""
    from moontrain.parallel.config import ParallelConfig

    auto = ParallelConfig()
    assert auto.dense == "auto"
    assert [auto.dense_at(1), auto.dense_at(2), auto.dense_at(8), auto.dense_at(1, distributed=False)] == \
        ["plain", "fsdp", "fsdp", "fsdp"]
    for mode in ("fsdp", "allreduce", "plain"):
        assert ParallelConfig(dense=mode).dense_at(1) == mode and ParallelConfig(dense=mode).dense_at(4) == mode


class _Block(torch.nn.Module):
    """Reads the shared state b twice (as AttnRes blocks read the completed blocks) and an fp32 table."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(d))
        self.w2 = torch.nn.Parameter(torch.randn(d))

    def forward(self, b: torch.Tensor, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        assert table.dtype == b.dtype  # cast to the compute dtype on the way in
        return x + (b * self.w1).tanh() * table + (b * self.w2).sigmoid()


class _Toy(torch.nn.Module):
    def __init__(self, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(d))
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(layers))
        self.table = torch.linspace(0.5, 1.5, d)

    def forward(self, scale: float) -> torch.Tensor:
        b = self.embed * scale
        x = b
        for block in self.layers:
            x = block(b, x, self.table)
        return (x.float() ** 2).sum()


def _toy_grads(rank: int, world: int) -> tuple[dict, dict]:
    def grads(dense: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = _Toy()
        if dense == "fsdp":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            model.set_requires_gradient_sync(False)
        else:
            plain = PlainDense(model, torch.bfloat16)
        for i, scale in enumerate((1.0, 0.5)):
            if dense == "fsdp":
                model.set_requires_gradient_sync(i == 1)
            model(scale).backward()
            if dense == "plain":
                plain.accumulate_grads()
        if dense == "plain":
            plain.reshard()
        return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                for n, p in model.named_parameters()}

    return grads("fsdp"), grads("plain")


def test_accumulators_hold_each_pass_that_gave_a_grad() -> None:
    """Four passes of one step whose sets of grads differ (one parameter without a grad in passes 2 and 4, as
    an unused one): every accumulator equals the fp32 sum of its bf16 grads in pass order (exact here: each
    pass's grad widened, then added), whichever cached scratch views a pass reused; the scratch holds two
    tensors at a time, so the views come in several groups."""
    torch.manual_seed(0)
    model = _Toy(d=64, layers=3)
    plain = PlainDense(model, torch.bfloat16)
    plain_dense_scratch, plain_dense.SCRATCH_BYTES = plain_dense.SCRATCH_BYTES, 4 * 64 * 2
    try:
        want = [None] * len(plain.masters)
        for step_pass, scale in enumerate((1.0, 0.5, 2.0, 0.25)):
            model(scale).backward()
            if step_pass in (1, 3):
                plain.compute[1].grad = None
            for i, c in enumerate(plain.compute):
                if c.grad is not None:
                    want[i] = c.grad.float() if want[i] is None else want[i] + c.grad.float()
            plain.accumulate_grads()
        plain.reshard()
    finally:
        plain_dense.SCRATCH_BYTES = plain_dense_scratch
    for i, m in enumerate(plain.masters):
        assert torch.equal(m.grad, want[i]), i
    assert len(plain._views[1]) > 1  # several scratch groups


def test_block_inputs_cast_and_grouped_as_fsdp_does() -> None:
    """A state read twice by every block, an fp32 input, bf16 compute, two passes: the fp32 grads equal
    FSDP2's bit for bit (its input casts and its one autograd node per block's inputs set the values)."""
    fsdp, plain = run_ranks(_toy_grads, 1)[0]
    assert_bitwise(plain, fsdp, "toy plain vs fsdp")
    assert all(g.dtype == torch.float32 for g in plain.values())


def test_copies_cast_again_unless_written_back() -> None:
    """Which compute copies the next forward casts (optim.write_back_dense): none after a cast; after an
    optimizer step only the masters it did not write back, even when their version counters did not move
    (torch's fused AdamW steps the masters in place without moving them: the copies stayed stale on a GPU,
    caught by test_plain_dense_gpu), plus a written one changed in place after it (QK-Clip, the router rows:
    the version moves); after a checkpoint load, all of them. The recast copies are the masters' casts."""
    torch.manual_seed(0)
    plain = PlainDense(_Toy(d=64, layers=2), torch.bfloat16)
    every = list(range(len(plain.masters)))
    assert plain.stale() == every
    plain.unshard()
    plain.reshard()
    assert plain.stale() == []
    plain.finish_step(frozenset(id(m) for m in plain.masters[1:]))
    assert plain.stale() == [0], "the master stepped without a write-back is cast again"
    with torch.no_grad():
        plain.masters[2].mul_(0.5)  # after the write-back: the version moves
    assert plain.stale() == [0, 2]
    plain.unshard()
    for i in (0, 2):
        assert torch.equal(plain.compute[i], plain.masters[i].detach().to(torch.bfloat16))
    plain.reshard()
    assert plain.stale() == []
    plain.invalidate()
    assert plain.stale() == every
