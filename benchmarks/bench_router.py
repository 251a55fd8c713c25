"""The router's forward and backward on one GPU at k3_small's shape: the PyTorch route (kernels.router=torch:
RouterLogits' split GEMMs, sigmoid, topk, the normalisation, the count) against the routing kernels
(kernels.router=triton, moontrain.model.router_kernel), as a step runs them: bf16 activations and router weights.

    python benchmarks/bench_router.py [--tokens 16384] [--experts 64 384] [--iters 20] [--warmup 3] [--out FILE]

Per case: the median ms of forward + backward (CUDA events; wall: with the host's launches inside the timed
call, device: with the host run ahead, benchmarks.timing.median_ms(host_ahead_ms=...)), the kernels each route
launches per call (torch.profiler, GPU activity), and the check against the PyTorch route: the choices equal
away from near-ties (the fraction of tokens whose choices differ, and the largest selection gap at which they
do), the weights' and gradients' largest difference relative to the largest magnitude. Hidden size 2048,
top-8; mean-free input sums on, as the recipe. A table is printed; --out writes JSON. GPU only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.timing import kernel_bench_args, median_ms
from moontrain.model.config import ModelConfig
from moontrain.model.router import Router

D, K = 2048, 8


def _router(E: int, kernel: str, w: torch.Tensor, bias: torch.Tensor) -> Router:
    cfg = ModelConfig(vocab_size=64, hidden_size=D, num_layers=2, dense_intermediate_size=64, num_heads=2,
                      q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                      num_experts=E, num_experts_per_tok=K, num_shared_experts=0, moe_intermediate_size=896,
                      moe_latent_size=1024, routed_scaling_factor=2.827, router_mean_free_updates=True)
    r = Router(cfg, kernel=kernel, device="cuda")
    r.weight.data = w.clone()  # bf16, as the mixed precision hands the router its compute copy
    with torch.no_grad():
        r.score_bias_E.copy_(bias)
    return r


def _step(r: Router, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xr = x.detach().requires_grad_()
    weights, topk, _ = r(xr, batch=4)
    (weights * g).sum().backward()
    out = (weights.detach(), topk, xr.grad, r.weight.grad)
    r.weight.grad = None
    return out


def _launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def case(S: int, E: int, iters: int, warmup: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(E)
    x = torch.randn(S, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(E, D, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(E, device="cuda", generator=gen) * 0.01
    g = torch.randn(S, K, device="cuda", generator=gen)
    routers = {kernel: _router(E, kernel, w, bias) for kernel in ("torch", "triton")}
    ref = _step(routers["torch"], x, g)
    rows = []
    for kernel, r in routers.items():
        got = _step(r, x, g)
        differ = (got[1] != ref[1]).any(-1)
        select = torch.sigmoid(x.float() @ w.float().t()) + bias
        top = select.topk(K + 1, dim=-1).values
        gap = (top[:, K - 1] - top[:, K])[differ]
        same = ~differ
        rel = {name: ((a[same].float() - b[same].float()).abs().max() / b[same].float().abs().max()).item()
               if name == "weights" else ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
               for name, a, b in (("weights", got[0], ref[0]), ("grad_x", got[2], ref[2]), ("grad_w", got[3], ref[3]))}
        wall = median_ms(lambda r=r: _step(r, x, g), iters, warmup)
        device = median_ms(lambda r=r: _step(r, x, g), iters, 1, host_ahead_ms=10.0)
        rows.append(dict(tokens=S, experts=E, route=kernel, wall_ms=wall, device_ms=device,
                         launches=_launches(lambda r=r: _step(r, x, g)), choices_differ=differ.float().mean().item(),
                         max_gap_where_differ=gap.max().item() if gap.numel() else 0.0, **{f"rel_{k}": v
                                                                                            for k, v in rel.items()}))
        print(f"  s {S} E {E} {kernel:6s}: wall {wall:.3f} ms, device {device:.3f} ms, {rows[-1]['launches']} launches",
              flush=True)
    return rows


def main() -> None:
    args = kernel_bench_args(__doc__, "bench_router", tokens=dict(type=int, default=16384),
                             experts=dict(type=int, nargs="+", default=[64, 384]))
    rows = []
    for E in args.experts:
        rows += case(args.tokens, E, args.iters, args.warmup)
    print(f"{torch.cuda.get_device_name()}; D {D}, top-{K}, bf16; median of {args.iters}; forward + backward")
    print(f"{'tokens':>7} {'E':>4} {'route':7} {'wall ms':>8} {'device ms':>9} {'launches':>8} {'differ':>7} "
          f"{'gap':>8} {'weights':>8} {'grad x':>8} {'grad w':>8}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['experts']:4d} {r['route']:7s} {r['wall_ms']:8.3f} {r['device_ms']:9.3f} "
              f"{r['launches']:8d} {r['choices_differ']:7.1e} {r['max_gap_where_differ']:8.1e} {r['rel_weights']:8.1e} "
              f"{r['rel_grad_x']:8.1e} {r['rel_grad_w']:8.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
