"""fla-core's chunk_kda (kda_ops.kda_fla) against the pure-PyTorch specification (kda_ops.kda) on one GPU:
forward and every gradient (q, k, v, the raw forget input f, beta, A_log, dt_bias), with and without
document starts, the K3 bounded gate and the Kimi Linear softplus gate; then the KDA layer and a whole
hybrid model step with kernels.kda=fla against =torch.

Tolerance, derived from bf16: the kernel reads bf16 inputs and keeps its intermediates (the chunk's
inverted L x L matrix, the WY factors, the chunk-boundary states) in bf16, each a rounding of relative
size 2^-9; along ~8 such roundings the errors add up to at most ~8 * 2^-9 = 2^-6 of the signal's RMS. The
specification computes in fp32 from the same bf16 inputs. So: RMS(fla - spec) <= 2^-6 * RMS(spec) for
the output and for each gradient (same inputs, same upstream gradient).
"""

from __future__ import annotations

import functools

import pytest
import torch

from moontrain.model.kda.layer import fla_available
from moontrain.model.kda.ops import kda, kda_fla

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fla_available(), reason="needs fla-core (bash ../shared/device/stage.sh fla)")]

REL_RMS = 2.0 ** -6


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).square().mean().sqrt() / want.float().square().mean().sqrt()).item()


def _inputs(B: int, T: int, H: int, K: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(B, T, H, K, generator=gen, **bf) for _ in range(3))
    f = torch.randn(B, T, H, K, generator=gen, **bf)
    beta = torch.rand(B, T, H, generator=gen, device="cuda")
    A_log = torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(H, K, generator=gen, device="cuda") - 2
    return [q, k, v, f, beta, A_log, dt_bias]


@pytest.mark.parametrize("bound", [-5.0, None], ids=["k3-bounded-gate", "softplus-gate"])
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
def test_fla_matches_spec(bound: float | None, documents: bool, recompute: bool) -> None:
    """recompute: kernels.kda_recompute (False: fla's backward reads the forward's saved states)."""
    B, T, H, K = 2, 1000, 16, 128  # T not a multiple of the chunk; k3_small's heads (fla's autotune keys)
    inputs = _inputs(B, T, H, K, seed=0)
    doc_start = None
    if documents:
        doc_start = torch.zeros(B, T, dtype=torch.bool, device="cuda")
        doc_start[0, [1, 64, 65, 300, 999]] = True  # one-token documents, a start on a chunk edge
        doc_start[1, 513] = True
    go = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for fn, cast in ((functools.partial(kda_fla, recompute=recompute), lambda t: t), (kda, lambda t: t.float())):
        leaves = [cast(t).detach().requires_grad_() for t in inputs]
        o = fn(*leaves, lower_bound=bound, scale=K ** -0.5, doc_start_BT=doc_start)
        grads = torch.autograd.grad(o, leaves, go.to(o.dtype))
        results.append((o, *grads))
    names = ("o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias")
    errors = {n: _rel_rms(a, b) for n, a, b in zip(names, *results, strict=True)}
    assert all(e <= REL_RMS for e in errors.values()), errors


def test_fla_with_the_forward_shared_bounds_is_bitwise_the_derived() -> None:
    """kda_fla given the forward's shared (device, host) cu_seqlens (DocumentMask.seq_bounds) equals kda_fla
    deriving them itself, output and every gradient bitwise (the same sequences; only the host syncs differ)."""
    from moontrain.model.documents import flat_sequence_bounds

    B, T, H, K = 2, 1000, 16, 128
    inputs = _inputs(B, T, H, K, seed=3)
    doc_start = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    doc_start[0, [1, 64, 300]] = doc_start[1, 513] = True
    go = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(4))
    results = []
    for bounds in (None, flat_sequence_bounds(doc_start)):
        leaves = [t.detach().requires_grad_() for t in inputs]
        o = kda_fla(*leaves, lower_bound=-5.0, scale=K ** -0.5, doc_start_BT=doc_start, seq_bounds=bounds)
        results.append((o, *torch.autograd.grad(o, leaves, go)))
    for name, a, b in zip(("o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias"), *results, strict=True):
        assert torch.equal(a, b), f"{name}: first mismatch at {(a != b).nonzero()[0].tolist()}"


def test_layer_fla_vs_torch_bf16() -> None:
    """The KDA layer in bf16 (as FSDP's mixed precision runs it) with packed documents: output and every
    parameter gradient of kernels.kda=fla against =torch (same weights)."""
    from moontrain.model.config import ModelConfig
    from moontrain.model.documents import document_mask
    from moontrain.model.kda.layer import KimiDeltaAttention

    results = []
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(2, 2048, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    go = torch.randn(2, 2048, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 2048), device="cuda", generator=gen)
    tokens[0, [100, 700, 701]], tokens[1, 1500] = 256, 256
    docs = document_mask(tokens, 256)
    for kernel in ("fla", "torch"):
        cfg = ModelConfig(vocab_size=257, hidden_size=512, num_layers=4, dense_intermediate_size=1024, num_heads=4,
                          kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=256, kda_layers_per_mla=3, kda_num_heads=16,
                          kda_head_dim=128)
        torch.manual_seed(0)
        m = KimiDeltaAttention(cfg, kernel=kernel, device="cuda")
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        m.init_parameters(torch.Generator("cuda").manual_seed(0))
        m.o_norm.weight.data.fill_(1.0)
        m = m.to(torch.bfloat16)
        o = m(x, docs=docs)
        o.backward(go)
        results.append({"o": o.detach(), **{n: p.grad.clone() for n, p in m.named_parameters()}})
    errors = {n: _rel_rms(results[0][n], results[1][n]) for n in results[1]}
    assert all(e <= REL_RMS for e in errors.values()), errors


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
def test_device_listed_chunks_match_the_host_listed_through_a_stack(recompute: bool) -> None:
    """kda_fla's device_chunks (fla's use_graph mode: the chunk list built on the device, no host sync) against
    the host-listed chunks, through three stacked KDA layers with residuals and packed documents: output and
    every input and parameter gradient. The stack matters: in that mode fla's backward returns some gradients in
    buffers it reuses for the next layer's backward, so a gradient read late would be overwritten (an error of
    the signal's size). The mode's kernels may tile differently, so the bound is the fla-vs-spec one (2^-6 of
    the RMS), not bitwise. recompute: kernels.kda_recompute (False: the backward reads the forward's states)."""
    from moontrain.model.documents import flat_sequence_bounds

    B, T, H, K, L = 2, 1000, 16, 128, 3
    gen = torch.Generator(device="cuda").manual_seed(5)
    x0 = torch.randn(B, T, H, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    layers = [_inputs(B, T, H, K, seed=10 + i)[3:] for i in range(L)]  # per layer: f, beta, A_log, dt_bias
    doc_start = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    doc_start[0, [1, 64, 65, 300, 999]] = doc_start[1, 513] = True
    bounds = flat_sequence_bounds(doc_start)
    go = torch.randn(B, T, H, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    results = []
    for device_chunks in (True, False):
        x = x0.detach().requires_grad_()
        params = [[t.detach().requires_grad_() for t in p] for p in layers]
        h = x
        for f, beta, A_log, dt_bias in params:
            h = h + kda_fla(h, h * 0.5, h.flip(-1), f, beta, A_log, dt_bias, lower_bound=-5.0, scale=K ** -0.5,
                            doc_start_BT=doc_start, seq_bounds=bounds, device_chunks=device_chunks,
                            recompute=recompute)
        leaves = [x, *(t for p in params for t in p)]
        results.append((h, *torch.autograd.grad(h, leaves, go)))
    errors = [_rel_rms(a, b) for a, b in zip(*results, strict=True)]  # 0: output, 1: dx, then f, beta, A_log,
    assert all(e <= REL_RMS for e in errors), errors                   # dt_bias per layer
