"""moontrain.model.router_kernel in Triton's interpreter on the CPU: the router with its routing kernels
(kernels.router=triton) against the same router on the PyTorch math (kernels.router=torch), bf16 activations and
weights as a GPU step hands them over: choices and counts bitwise, weights and gradients within derived bounds;
the kernel's tie and NaN rules.

Bounds (u = 2^-24). Weights: the scores differ by the exp (numpy's here, torch's in the reference) within 2 u,
the K-term sum of the chosen scores adds K u, the division and the scaling 2 u: (K + 6) u relative, taken 4x.
Gradients: the kernel hands the GEMMs the logits' gradient as two bf16 terms, which the interpreter truncates
(|g - hi - lo| < 2^-15 |g|; the GPU rounds: 2^-16); both sides round the result to bf16 once, which can differ by
one bf16 ulp (2^-8) where the fp32 values straddle a rounding boundary. So |diff| <= 2^-8 max|want| + 2^-14
max(|g| |w|) (|g| |x| for the weight), the second term twice the split's error over the GEMM's magnitudes.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and skips this module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model.config import ModelConfig
from moontrain.model.router import Router
from moontrain.model.router_kernel import routed_scores

U = 2.0**-24


def _cfg(E: int, K: int, D: int = 48) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=D, num_layers=2, dense_intermediate_size=64, num_heads=2,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       num_experts=E, num_experts_per_tok=K, num_shared_experts=0, moe_intermediate_size=128,
                       routed_scaling_factor=2.5, router_mean_free_updates=True)


def _pair(E: int, K: int, seed: int, skew: float) -> tuple[Router, Router]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, 48, generator=gen) * 0.3).bfloat16()
    bias = torch.randn(E, generator=gen) * 0.05
    routers = []
    for kernel in ("torch", "triton"):
        r = Router(_cfg(E, K), kernel=kernel)
        r.weight.data = w.clone()
        with torch.no_grad():
            r.score_bias_E.copy_(bias)
        r.set_skew(skew)
        routers.append(r)
    assert not routers[0].kernel and routers[1].kernel
    return routers[0], routers[1]


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    diff = (got.double() - want.double()).abs().max().item()
    assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize(("E", "K", "s", "skew"), [(16, 2, 37, 0.0), (20, 3, 16, 0.0), (16, 4, 50, 0.7),
                                                   (64, 8, 33, 0.0), (7, 7, 5, 0.0), (300, 8, 20, 0.0)])
def test_kernel_route_matches_the_pytorch_math(E: int, K: int, s: int, skew: float) -> None:
    ref, ker = _pair(E, K, seed=E + K + s, skew=skew)
    gen = torch.Generator().manual_seed(s)
    x = torch.randn(s, 48, generator=gen).bfloat16()
    g = torch.randn(s, K, generator=gen)
    outs = []
    for r in (ref, ker):
        xr = x.clone().requires_grad_()
        weights, topk, aux = r(xr, batch=1)
        (weights * g).sum().backward()
        outs.append((weights, topk, xr.grad, r.weight.grad))
        assert aux is None
    (w_ref, t_ref, gx_ref, gw_ref), (w_ker, t_ker, gx_ker, gw_ker) = outs
    assert torch.equal(t_ker, t_ref), "the choices"
    assert t_ker.dtype == torch.int64 and w_ker.dtype == torch.float32
    assert torch.equal(ker.tokens_per_expert_E, ref.tokens_per_expert_E), "the counts"
    assert ker.tokens_per_expert_E.sum().item() == s * K
    assert torch.equal(ker.input_sum_D, ref.input_sum_D), "the mean-free input sums"
    _close("weights", w_ker, w_ref, 4 * (K + 6) * U * w_ref.abs().max().item())

    # the bounds' magnitudes: |dL/dlogits| (float64) times |w| and |x|
    gl = _logit_grad(x, ref.weight.detach(), t_ref, g, ref.scaling)
    _close("grad x", gx_ker, gx_ref, 2**-8 * gx_ref.abs().max().item()
           + 2**-14 * (gl.abs() @ ref.weight.detach().double().abs()).max().item())
    _close("grad w", gw_ker, gw_ref, 2**-8 * gw_ref.abs().max().item()
           + 2**-14 * (gl.abs().T @ x.double().abs()).max().item())


def _logit_grad(x, w, topk, g, scaling) -> torch.Tensor:
    """dL/dlogits in float64 for L = sum(weights * g)."""
    logits = (x.double() @ w.double().T).requires_grad_()
    a = torch.sigmoid(logits).gather(1, topk)
    ((a / a.sum(-1, keepdim=True) * scaling) * g.double()).sum().backward()
    return logits.grad


def test_not_counting_leaves_the_statistics() -> None:
    _, ker = _pair(16, 2, seed=1, skew=0.0)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    with ker.not_counting():
        ker(x, batch=1)
    assert ker.tokens_per_expert_E.sum().item() == 0 and ker.input_sum_D.abs().sum().item() == 0


def test_ties_take_the_lowest_experts_and_nan_rows_stay_in_range() -> None:
    E, K, s = 12, 3, 5
    x = torch.randn(s, 8).bfloat16()
    x[3, 2] = float("nan")
    w = torch.zeros(E, 8).bfloat16()  # every logit 0 (row 3 NaN): every expert ties at sigmoid(0) + bias
    bias = torch.zeros(E)
    bias[[4, 9]] = 0.25  # two clear winners, then a tie among the rest
    counts = torch.zeros(E, dtype=torch.int64)
    weights, topk = routed_scores(x, w, bias, None, counts, K, 1.0)
    for row in (0, 1, 2, 4):
        assert topk[row].tolist() == [4, 9, 0], topk[row]
        assert torch.equal(weights[row], torch.full((K,), 1 / 3))
    assert sorted(set(topk[3].tolist())) == sorted(topk[3].tolist()) and topk[3].max().item() < E
    assert counts.sum().item() == s * K


def test_bad_inputs_name_the_fix() -> None:
    x, w, bias = torch.zeros(4, 8).bfloat16(), torch.zeros(6, 8).bfloat16(), torch.zeros(6)
    with pytest.raises(ValueError, match=r"kernels\.router=torch"):
        routed_scores(x.float(), w, bias, None, None, 2, 1.0)
    with pytest.raises(ValueError, match=r"1 <= K <= E"):
        routed_scores(x, w, bias, None, None, 7, 1.0)
    with pytest.raises(ValueError, match="bias_E"):
        routed_scores(x, w, bias.double(), None, None, 2, 1.0)
    with pytest.raises(ValueError, match="counts_E"):
        routed_scores(x, w, bias, None, torch.zeros(6, dtype=torch.int32), 2, 1.0)


def test_routers_the_kernels_cannot_take_fall_back_or_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto runs the PyTorch math where the kernels do not apply (auto picks kernels on CUDA only: the device
    check is patched to say CUDA); triton is refused at construction, naming the reason and the fix. K3's 896
    experts: beyond the kernel's 512."""
    import dataclasses

    from moontrain.model import kernel_choice

    choose = kernel_choice.runs_cuda_kernels
    monkeypatch.setattr(kernel_choice, "runs_cuda_kernels",
                        lambda option, choice, device, path: choice == "auto" or choose(option, choice, device, path))
    base = _cfg(16, 2)
    assert Router(base, kernel="auto").kernel  # the shape the kernels take
    for over, reason in (({"num_experts": 896, "num_experts_per_tok": 16, "moe_latent_size": 16}, "896 experts"),
                         ({"num_expert_groups": 4, "topk_expert_groups": 2}, "num_expert_groups=4"),
                         ({"seq_aux_loss_coef": 1e-3}, "seq_aux_loss_coef")):
        cfg = dataclasses.replace(base, **over)
        assert not Router(cfg, kernel="auto").kernel
        with pytest.raises(ValueError, match=rf"kernels\.router=triton: .*{reason}.*kernels\.router=auto"):
            Router(cfg, kernel="triton")
    assert not Router(base, kernel="auto", gemm="fp32").kernel
    forced = Router(base, kernel="triton")
    with pytest.raises(ValueError, match=r"needs bf16 activations and router weights"):
        forced(torch.zeros(3, 48), batch=1)  # fp32 weights and activations
