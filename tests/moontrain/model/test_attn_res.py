"""Block Attention Residuals against an independent naive formulation written here from the paper
(arXiv 2603.15031): stack the values, RMSNorm them (with the norm's weight) as keys, score with the
pseudo-query, softmax over depth, weighted sum; blocks of S/2 transformer layers, the embedding as
the first block, one more aggregation before the final norm.

Tolerances: the op in fp64 against the naive form in fp64 (autograd through it for the gradients):
1e-12 relative (different summation order only). The model in fp32 against the naive loop in fp32:
the same parameters and sub-modules, only the aggregation's arithmetic order differs: 1e-5 relative.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from moontrain.metrics.flops import flops_per_token
from moontrain.model.attn_res import (
    BlockGrad,
    DepthAttention,
    aggregate_backward,
    aggregate_forward,
    aggregation_sizes,
    complete_block,
    residual_add,
    residual_grad,
    starts_block,
)
from moontrain.model.config import KernelsConfig, ModelConfig
from moontrain.model.experts import ExpertsContext
from moontrain.model.params import count_params
from moontrain.model.transformer import K3Model


def naive_aggregate(values: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    v_NBTD = torch.stack(values)
    k_NBTD = v_NBTD * torch.rsqrt(v_NBTD.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    alpha_NBT = torch.einsum("d,nbtd->nbt", query, k_NBTD).softmax(0)
    return torch.einsum("nbt,nbtd->btd", alpha_NBT, v_NBTD)


@pytest.mark.parametrize("num_values,compiled", [(1, False), (2, False), (5, False), (3, True)])
def test_depth_attention_matches_naive_formulation(num_values: int, compiled: bool) -> None:
    """Forward and every gradient against the naive fp64 formulation; also the torch.compile'd math
    (train.compile), whose fused reductions only reorder fp64 sums."""
    if compiled and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    g = torch.Generator().manual_seed(num_values)
    D = 24
    values = [(torch.randn(2, 7, D, generator=g, dtype=torch.float64) * (1 + i)).requires_grad_()
              for i in range(num_values)]
    m = DepthAttention(D, eps=1e-6).double()
    if compiled:
        m.compile_math()
    with torch.no_grad():
        m.query.copy_(torch.randn(D, generator=g, dtype=torch.float64))
        m.key_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64))
    grad_h = torch.randn(2, 7, D, generator=g, dtype=torch.float64)
    got = m(tuple(values[:-1]), values[-1])
    got_grads = torch.autograd.grad(got, [*values, m.query, m.key_norm.weight], grad_h)
    want = naive_aggregate(values, m.query, m.key_norm.weight, 1e-6)
    want_grads = torch.autograd.grad(want, [*values, m.query, m.key_norm.weight], grad_h)
    names = [f"value {i}" for i in range(num_values)] + ["query", "key norm weight"]
    for name, a, b in zip(["h", *names], [got, *got_grads], [want, *want_grads], strict=True):
        diff, tol = (a - b).abs().max().item(), 1e-12 * max(b.abs().max().item(), 1.0)
        assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def test_zero_query_is_the_mean_and_bf16_rounds_once() -> None:
    """At init (query 0) every value weighs 1/N; bf16 values give the fp32 result rounded once."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 5, 16, generator=g).to(torch.bfloat16) for _ in range(3)]
    got = DepthAttention(16)(tuple(values[:-1]), values[-1])
    want = (sum(v.float() for v in values) / 3).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() <= 2.0**-8 * want.float().abs().max().item()


def _cfg(**over) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=5, num_dense_layers=1, dense_intermediate_size=64,
                num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                num_experts=8, num_experts_per_tok=3, num_shared_experts=1, moe_intermediate_size=128,
                moe_latent_size=16, routed_scaling_factor=2.5, attn_res_block_size=4, ffn_activation="situ_glu")
    return ModelConfig(**{**base, **over})


def _model(cfg: ModelConfig, kernels: KernelsConfig | None = None) -> K3Model:
    model = K3Model(cfg, kernels=kernels)
    model.init_weights(seed=0)
    with torch.no_grad():  # non-zero queries so the depth weights are not uniform
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.copy_(torch.randn(p.shape, generator=gen))
    model.attach_experts_backends("local", ExpertsContext(
        num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep=1,
        compute_dtype=torch.float32, token_padding=8, max_tokens=18, device=torch.device("cpu"),
        activation=cfg.ffn_activation))
    return model


def param_grads(model: K3Model, tokens_BT: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient of the model's loss on next-token targets, by name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = model(tokens_BT, tokens_BT.roll(-1, 1))[0]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return dict(zip([n for n, _ in named], grads, strict=True))


def naive_forward(model: K3Model, tokens_BT: torch.Tensor, block_size: int,
                  sizes: list[int] | None = None) -> torch.Tensor:
    """Block AttnRes as the paper's pseudocode reads, around the model's own sub-modules; appends the
    number of values of each aggregation to `sizes`."""
    from moontrain.model.rope import rope_cos_sin

    cfg = model.cfg
    cos, sin = rope_cos_sin(tokens_BT.shape[1], cfg.qk_rope_head_dim, cfg.rope_theta, tokens_BT.device)
    blocks: list[torch.Tensor] = []
    partial = model.embed(tokens_BT)

    def aggregate(res: DepthAttention, values: list[torch.Tensor]) -> torch.Tensor:
        if sizes is not None:
            sizes.append(len(values))
        return naive_aggregate(values, res.query, res.key_norm.weight, res.key_norm.eps)

    for i, layer in enumerate(model.layers):
        h = aggregate(layer.res_attn, [*blocks, partial])
        if i % (block_size // 2) == 0:
            blocks.append(partial)
            partial = None
        out = layer.attn(layer.attn_norm(h), cos, sin)
        partial = out if partial is None else partial + out
        h = aggregate(layer.res_ffn, [*blocks, partial])
        y = layer.ffn(layer.ffn_norm(h))
        partial = partial + (y[0] if layer.is_moe else y)
    return model.lm_head(model.norm(aggregate(model.final_res, [*blocks, partial])))


@pytest.mark.parametrize(("block_size", "kda"), [(2, 0), (4, 0), (12, 0), (4, 1)],
                         ids=["bs2", "bs4", "bs12", "bs4_hybrid_kda"])
def test_model_matches_naive_block_attn_res(block_size: int, kda: int) -> None:
    """Block sizes 2 (a block per layer), 4 (blocks start at layers 0, 2, 4 of 5) and 12 (one block:
    the embedding and one partial sum); with the hybrid KDA/MLA layout too (the full K3 block)."""
    cfg = _cfg(attn_res_block_size=block_size, kda_layers_per_mla=kda, kda_head_dim=16)
    model = _model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    targets = tokens.roll(-1, 1)
    _, ce = model(tokens, targets)
    sizes: list[int] = []
    logits = naive_forward(model, tokens, block_size, sizes)
    want = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size), targets.reshape(-1))
    assert abs(ce.item() - want.item()) <= 1e-5 * abs(want.item()), (ce.item(), want.item())
    assert aggregation_sizes(cfg.num_layers, block_size) == sizes


def test_counts_and_flops_cover_attn_res() -> None:
    """AttnRes adds 2 D-vectors per aggregation (2 per layer + 1) to the parameters and 12 D N FLOPs per
    token per aggregation over N values; SiTU-GLU changes neither."""
    on, off = _cfg(attn_res_block_size=4), _cfg(attn_res_block_size=0, ffn_activation="swiglu")
    c_on, c_off = count_params(on), count_params(off)
    D, L = on.hidden_size, on.num_layers
    assert c_on.attn_res == (2 * L + 1) * 2 * D and c_off.attn_res == 0
    assert c_on.total - c_off.total == c_on.attn_res and c_on.active - c_off.active == c_on.attn_res
    sizes = [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]  # blocks start at layers 0, 2, 4 of 5
    assert flops_per_token(on, 64) - flops_per_token(off, 64) == 12 * D * sum(sizes)


def test_init_zeroes_the_queries_and_block_size_is_validated() -> None:
    model = K3Model(_cfg())
    model.init_weights(seed=0)
    queries = {n: p for n, p in model.named_parameters() if n.endswith(".query")}
    assert len(queries) == 2 * 5 + 1 and all(not p.any() for p in queries.values())
    assert all(p.eq(1).all() for n, p in model.named_parameters() if n.endswith("key_norm.weight"))
    with pytest.raises(ValueError, match="attn_res_block_size must be an even number"):
        _cfg(attn_res_block_size=3)
    with pytest.raises(ValueError, match="ffn_activation must be 'swiglu' or 'situ_glu'"):
        _cfg(ffn_activation="gelu")
    with pytest.raises(ValueError, match=r"computes 'swiglu' experts, the model has model\.ffn_activation='situ_glu'"):
        model.attach_experts_backends("local", ExpertsContext(
            num_experts=8, topk=3, ep_group=None, ep=1, compute_dtype=torch.float32, token_padding=8,
            max_tokens=18, device=torch.device("cpu")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_math_matches_eager_gpu() -> None:
    """train.compile's fused aggregation on the GPU against the eager op, bf16 values as in training:
    both accumulate in fp32 and round h once, so they differ by the fp32 summation order plus at most
    one bf16 rounding step of h (2^-8 relative); the gradients likewise."""
    g = torch.Generator(device="cuda").manual_seed(0)
    D = 2048
    values = [torch.randn(2, 512, D, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
              for _ in range(4)]
    grad_h = torch.randn(2, 512, D, generator=g, device="cuda").to(torch.bfloat16)
    results = []
    for compiled in (False, True):
        m = DepthAttention(D).cuda()
        with torch.no_grad():
            m.query.copy_(torch.randn(D, generator=g, device="cuda") * 0.05 if not results else results[0][-1])
        if compiled:
            m.compile_math()
        h = m(tuple(values[:-1]), values[-1])
        grads = torch.autograd.grad(h, [*values, m.query], grad_h)
        results.append((h, *grads, m.query.detach().clone()))
    for name, a, b in zip(["h", "v0", "v1", "v2", "partial", "query"], results[1][:-1], results[0][:-1], strict=True):
        diff, scale = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
        assert diff <= 2.0**-8 * scale, f"{name}: max |diff| {diff:.3g} vs max |value| {scale:.3g}"


class _ProductOutside(torch.autograd.Function):
    """The aggregation with q = query * key-norm weight made outside the op, by autograd (the
    formulation DepthAttention folds in): the reference its results must equal bit for bit."""

    @staticmethod
    def forward(ctx, q_D, eps, math, *values):
        h, r_NBT, p_NBT = math[0](q_D, eps, values)
        ctx.save_for_backward(q_D, r_NBT, p_NBT, *values)
        ctx.backward_math = math[1]
        return h

    @staticmethod
    def backward(ctx, grad_h):
        q_D, r_NBT, p_NBT, *values = ctx.saved_tensors
        grad_q, grad_values = ctx.backward_math(q_D, r_NBT, p_NBT, grad_h, tuple(values))
        return grad_q, None, None, *grad_values


def _fold_case(device: str, compiled: bool) -> None:
    """bf16 parameters (FSDP's compute copies) and bf16 values: h and every gradient of DepthAttention
    equal the product-outside formulation's, bitwise (both through torch.compile when `compiled`)."""
    g = torch.Generator(device=device).manual_seed(3)
    D = 256 if device == "cuda" else 32
    values = [torch.randn(2, 64, D, generator=g, device=device).to(torch.bfloat16).requires_grad_()
              for _ in range(4)]
    grad_h = torch.randn(2, 64, D, generator=g, device=device).to(torch.bfloat16)
    m = DepthAttention(D, device=device).to(torch.bfloat16)
    with torch.no_grad():
        m.query.copy_(torch.randn(D, generator=g, device=device) * 0.3)
        m.key_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g, device=device))
    math = (aggregate_forward, aggregate_backward)
    if compiled:
        m.compile_math()
        math = (torch.compile(aggregate_forward, dynamic=False), torch.compile(aggregate_backward, dynamic=False))
    inputs = [*values, m.query, m.key_norm.weight]
    got = m(tuple(values[:-1]), values[-1])
    got_grads = torch.autograd.grad(got, inputs, grad_h)
    q_D = m.query.float() * m.key_norm.weight.float()
    want = _ProductOutside.apply(q_D, m.key_norm.eps, math, *values)
    want_grads = torch.autograd.grad(want, inputs, grad_h)
    names = ["h", *(f"value {i}" for i in range(len(values))), "query", "key norm weight"]
    for name, a, b in zip(names, [got, *got_grads], [want, *want_grads], strict=True):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} vs {b.dtype}"
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"
        assert bool(a.abs().sum() > 0), f"{name} is zero: the test checks nothing"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parameters_fold_into_the_op_bitwise(compiled: bool) -> None:
    """The query * key-norm weight product and its gradients made inside the op (where train.compile
    fuses them) change no bit, eager or through torch.compile (inductor's CPU code)."""
    if compiled and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    _fold_case("cpu", compiled=compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_parameters_fold_into_the_compiled_op_bitwise_gpu() -> None:
    """train.compile: the product and the parameters' gradients fused into the compiled math give the
    bits of the product made outside it (eager casts and multiplies around the compiled aggregation)."""
    _fold_case("cuda", compiled=True)


def test_triton_kernels_off_cuda_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.attn_res=triton on the CPU without Triton's interpreter: an error that names the fix."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"kernels.attn_res=triton runs on a CUDA device .* this model is on cpu; "
                                         r"kernels.attn_res=auto picks the PyTorch math there"):
        DepthAttention(16, device="cpu", kernel="triton")
    from moontrain.model import attn_res

    assert DepthAttention(16, device="cpu", kernel="auto").math is attn_res.EAGER


def _chain_grads(commit: bool, compiled: bool = False) -> list[torch.Tensor]:
    """Five aggregations over two completed blocks (the second committed after the second aggregation, as a
    layer commits its partial sum) and a changing partial sum, bf16 as in training: the gradients of the two
    blocks' sources, the partial sums' source and every query. commit: the blocks through complete_block
    (their readers sum into its BlockGrad) and the partial sums through residual_add (the aggregation reading
    one sums the add's gradient), else plain tensors and adds (autograd sums their gradients)."""
    g = torch.Generator().manual_seed(5)
    D = 32
    x0, x1 = (torch.randn(2, 9, D, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    aggs = [DepthAttention(D).to(torch.bfloat16) for _ in range(5)]
    with torch.no_grad():
        for m in aggs:
            m.query.copy_(torch.randn(D, generator=g) * 0.5)
    if compiled:
        for m in aggs:
            m.compile_math()
    blocks = (complete_block(x0) if commit else x0 * 1,)
    partial = x1 * 1
    for i, m in enumerate(aggs):
        sink = residual_grad(partial) if commit else None
        partial = residual_add(partial, torch.tanh(m(blocks, partial, sink)), sink)
        if i == 1:
            blocks = (*blocks, complete_block(partial) if commit else partial * 1)
            partial = partial * 0.5
    return list(torch.autograd.grad(partial.float().pow(2).sum(), [x0, x1, *(m.query for m in aggs)]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_block_gradients_summed_by_the_readers_equal_autograds_sum_bitwise(compiled: bool) -> None:
    """complete_block: every aggregation adds its gradient of a completed block into the block's BlockGrad, in
    the order autograd would have summed them, in the values' dtype; residual_add: the aggregation reading a
    partial sum adds its gradient to the add's. Every gradient equals autograd's own summing bit for bit (the
    partial sum that became a block also receives a plain gradient: both meet)."""
    if compiled and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    got, want = _chain_grads(commit=True, compiled=compiled), _chain_grads(commit=False, compiled=compiled)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"gradient {i}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"
        assert bool(a.abs().sum() > 0), f"gradient {i} is zero: the test checks nothing"


def test_a_residual_gradient_the_math_cannot_add_into_is_summed_apart() -> None:
    """The residual add's gradient arrives as the expanded ones of a sum's backward (stride 0: the kernels cannot
    store into it): the aggregation's backward adds the two out of place; the same gradients as autograd's sum,
    bit for bit (fp32, one rounding either way). Without grad, residual_grad gives no slot and the add is plain."""
    g = torch.Generator().manual_seed(7)
    block = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    m = DepthAttention(16)
    with torch.no_grad():
        m.query.copy_(torch.randn(16, generator=g))
    partial = x * 1
    sink = residual_grad(partial)
    got = torch.autograd.grad(residual_add(partial, torch.tanh(m((block,), partial, sink)), sink).sum(), [x, block])
    partial = x * 1
    want = torch.autograd.grad((partial + torch.tanh(m((block,), partial))).sum(), [x, block])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) and bool((a - 1).abs().sum() > 0)
    with torch.no_grad():
        assert residual_grad(partial) is None
    with pytest.raises(ValueError, match="belongs to a partial sum"):
        m((block,), None, residual_grad(partial))


def test_complete_block_is_the_tensor_itself_without_gradients() -> None:
    x = torch.randn(2, 3, 4, requires_grad=True)
    with torch.no_grad():
        assert complete_block(x) is x
    assert complete_block(x.detach()) is not x and not hasattr(complete_block(x.detach()), "attn_res_grad")
    block = complete_block(x)
    assert block is not x and isinstance(block.attn_res_grad, BlockGrad) and torch.equal(block, x)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_model_gradients_with_block_sums_equal_autograds_bitwise(checkpointing: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every parameter's gradient of the K3 block (KDA and MLA, MoE, block size 4: blocks committed at layers
    0, 2 and 4 and read by up to eleven aggregations) with the readers summing into BlockGrad and the partial
    sums' aggregations into their residual adds' gradients, against the same model where autograd sums every
    such pair (complete_block the identity, no ResidualGrad): bit for bit. With activation checkpointing the
    sums cross the recomputed blocks' boundaries."""
    from moontrain.model import transformer

    cfg = _cfg(attn_res_block_size=4, kda_layers_per_mla=1, kda_head_dim=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    runs = []
    for summed_by_readers in (True, False):
        if not summed_by_readers:
            monkeypatch.setattr(transformer, "complete_block", lambda x: x)
            monkeypatch.setattr(transformer, "residual_grad", lambda x: None)
        model = _model(cfg)
        if checkpointing:
            model.enable_activation_checkpointing()
        runs.append(param_grads(model, tokens))
    checked = 0
    for name, a in runs[0].items():
        b = runs[1][name]
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3g}"
            checked += bool(a.abs().max() > 0)
    assert checked >= len(runs[0]) // 2, f"only {checked} of {len(runs[0])} gradients are non-zero"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_readers_sum_into_block_grads_under_the_dense_hooks(checkpointing: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """parallel.dense=plain's (and FSDP's) pre-forward hooks pass every block's tensor inputs that need grad
    through an identity autograd node; the completed blocks travel in CompletedBlocks, which they do not look
    into, so every aggregation still reads the committed blocks themselves and sums into their BlockGrad: all
    sum(N - 1) block reads of the model plus the committing layers' reads of the block they commit (18 + 3 for 5
    layers in blocks of 4 sub-layers; 9 if only the committing layers and the final aggregation saw them), and
    every other aggregation but the final one sums its residual add's gradient (2 x 5 - 3)."""
    from moontrain.model import attn_res
    from moontrain.parallel.plain_dense import PlainDense

    cfg = _cfg(attn_res_block_size=4, kda_layers_per_mla=1, kda_head_dim=16)
    model = _model(cfg)
    PlainDense(model, torch.float32)
    if checkpointing:
        model.enable_activation_checkpointing()
    reads: list[int] = []
    residuals: list[bool] = []
    backward = attn_res._DepthAttention.backward

    def counting(ctx, grad_h):
        reads.append(sum(s is not None for s in ctx.sinks))
        residuals.append(ctx.residual is not None and ctx.residual.grad is not None)
        return backward(ctx, grad_h)

    monkeypatch.setattr(attn_res._DepthAttention, "backward", staticmethod(counting))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    model(tokens, tokens.roll(-1, 1))[0].backward()
    sizes = aggregation_sizes(cfg.num_layers, 4)
    commits = sum(starts_block(i, 4) for i in range(cfg.num_layers))
    assert commits == 3 and len(reads) == len(sizes)
    assert sum(reads) == sum(n - 1 for n in sizes) + commits == 21
    assert sum(residuals) == 2 * cfg.num_layers - commits == 7


def test_a_block_read_outside_the_aggregations_sums_both() -> None:
    """A completed block that another op also reads: its node adds that op's gradient to the readers' sum. The
    three gradients meet in another order than autograd's: fp32, within 2 u of the sum of their magnitudes."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    partial = torch.randn(2, 5, 16, generator=g)
    m = DepthAttention(16)
    with torch.no_grad():
        m.query.copy_(torch.randn(16, generator=g))

    def terms(block: torch.Tensor) -> list[torch.Tensor]:
        return [m((block,), partial).pow(2).sum(), m((block,), partial * 2).sum(), (block * 3).sum()]

    got = torch.autograd.grad(sum(terms(complete_block(x))), x)[0]
    parts = [torch.autograd.grad(terms(x * 1)[i], x)[0] for i in range(3)]
    want = parts[0] + parts[1] + parts[2]
    bound = 2 * 2.0**-24 * sum(p.abs() for p in parts)
    assert bool(((got - want).abs() <= bound).all()) and bool(got.abs().sum() > 0)
