"""One H200: the hierarchical EP code path and the sharded expert state run on CUDA at world 1.

- moonep.hierarchical at N = 1 host of G = 1 rank (a one-rank NCCL group as host group and rail group):
  route, host dispatch and combine (no remote host), the host Buffer in entries mode (PyTorch data path)
  on the CUDA symmetric heap. At one rank the host stage is the one-level problem itself (the caps of
  s*K entries, the same plan), so the result equals the one-level moonep layer on the same (PyTorch) data
  path bitwise: output, grads of x and route weights, and every expert weight grad.
- parallel.shard_expert_state=true at world 1 (one replica: the shard is every row) trains to the
  unsharded run's losses, parameters and Adam state bitwise (train.deterministic on).

    python -m pytest -q -m gpu tests/moontrain/parallel/test_hierarchical_gpu.py     (< 1 min)

The two-host GPU run (2 hosts of 1 GPU) belongs to the 2xH200 run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, expert_glu, glu_projections, merge_gate_up
from moonep.hierarchical import HierarchicalBuffer, hierarchical_expert_glu, host_groups
from moonep.routing import generate_routing

pytestmark = pytest.mark.gpu

# 512 x 2048 bf16 = 2 MiB per expert matrix: one VMM granule, as the CUDA heap requires
E, H, F, K, S = 16, 512, 2048, 4, 64
DEVICE = torch.device("cuda")


def _problem():
    g = torch.Generator().manual_seed(99)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    gate, up = (torch.randn(E, H, F, generator=g) / H**0.5 for _ in range(2))
    w = {"gate_up": merge_gate_up(gate, up), "down": torch.randn(E, F, H, generator=g) / F**0.5}  # glu_projections
    w = {k: v.to(torch.bfloat16) for k, v in w.items()}
    topk = generate_routing(num_ranks=1, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=2.0,
                            seed=5).topk_RsK[0].to(torch.int32)
    return x, w, topk, torch.rand(S, K, generator=g), torch.randn(S, H, generator=g).to(torch.bfloat16)


def _layer(pools: ExpertPools, w: dict[str, torch.Tensor]):
    layer = pools.add_layer()
    for p in w:
        layer.w_local[p].copy_(w[p])
    return layer


def _run(call, x, weights, grad_y, layer, wait) -> dict[str, torch.Tensor]:
    x_sH = x.to(DEVICE, copy=True).requires_grad_()
    w_sK = weights.to(DEVICE, copy=True).requires_grad_()
    y = call(x_sH, w_sK)
    (y.double() * grad_y.to(DEVICE).double()).sum().backward()
    wait()
    torch.cuda.synchronize()
    out = {"y": y.detach(), "grad x": x_sH.grad, "grad route weights": w_sK.grad,
           **{f"grad W_{p}": layer.g_local[p] for p in layer.g_local}}
    return {k: v.to("cpu", copy=True) for k, v in out.items()}  # copies: the heap goes with the buffer


def test_hierarchical_one_rank_equals_one_level(one_rank: dist.ProcessGroup) -> None:
    x, w, topk, weights, grad_y = _problem()
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E)
    proj = glu_projections(H, F)
    host, rail = host_groups([[0]], 1)
    with HierarchicalBuffer(cfg, host, rail) as hbuf:
        assert hbuf.host.kernel_path == "torch" and hbuf.host.config.entries
        pools = hbuf.make_pools(proj)
        layer = _layer(pools, w)
        got = _run(lambda a, b: hierarchical_expert_glu(hbuf, pools, layer, a, b, topk.to(DEVICE)),
                   x, weights, grad_y, layer, hbuf.host.wait_pending)
    for kernels in ("torch",):  # the Triton path's expert math matches it within tolerance only (tests/moonep/kernels)
        buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E,
                                  options=BufferOptions(kernels=kernels)), one_rank)
        try:
            pools = ExpertPools(buf, proj)
            layer = _layer(pools, w)
            want = _run(lambda a, b, buf=buf, pools=pools, layer=layer:
                        expert_glu(buf, pools, layer, a, b, topk.to(DEVICE)),
                        x, weights, grad_y, layer, buf.wait_pending)
        finally:
            buf.destroy()
        for name, ref in want.items():
            bad = torch.nonzero(got[name] != ref)
            assert got[name].dtype == ref.dtype and len(bad) == 0, (
                f"{name} vs one-level ({kernels}): {len(bad)} elements differ, first at {bad[0].tolist()}")


def test_shard_expert_state_one_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", 0)
    losses, states = {}, {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        _train_both(tmp_path, device, losses, states)
    finally:  # train.deterministic switches it on process-wide; the session's other tests run as before
        torch.use_deterministic_algorithms(deterministic)
    assert losses[True] == losses[False], losses
    assert states[True].keys() == states[False].keys(), sorted(states[True].keys() ^ states[False].keys())
    assert any(k.endswith("exp_avg_sq") for k in states[False])
    for key, ref in states[False].items():
        assert torch.equal(states[True][key], ref), f"sharded expert state differs from unsharded at {key}"


def _train_both(tmp_path: Path, device: torch.device, losses: dict, states: dict) -> None:
    from moontrain.parallel.layout import single_process_layout
    from moontrain.trainer.trainer import Trainer
    from tests.moontrain.ckpt_utils import full_state, small_config, train

    for shard in (False, True):
        cfg = small_config("local", 1, steps=3, run_dir=str(tmp_path / str(shard)))
        cfg.parallel.shard_expert_state = shard
        cfg.optim.write_back = False  # the sharded state is built for plain AdamW (the fused write-back is refused)
        cfg.train.deterministic = True
        trainer = Trainer(cfg, single_process_layout(device))
        assert trainer.experts[0].sharded == shard
        losses[shard] = train(trainer, 3)
        # at one replica the sharded masters and their Adam moments hold every row: canonical as they are
        states[shard] = {k: v.cpu() for k, v in full_state(trainer).items()}
        trainer.close()
