"""The KDA layer, the hybrid layout and document masking, against references written here.

- The layer (fp64) equals its definition composed from independent pieces: F.conv1d for the short
  convolutions, the L2 norm, the gate formula, the token-by-token recurrence of test_kda_ops, F.rms_norm.
- K3's layout: 93 layers = 69 KDA + 24 MLA, MLA at 1-based layers 4, 8, ..., 92 and 93.
- Documents: a token's output (logits of the whole hybrid model) is bitwise unchanged when an earlier
  document of its row changes, and equals the output of its document run alone (fp32, 1e-5 of the
  largest value: the chunk boundaries fall elsewhere, so the sums run in another order).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from moontrain.model.attention import MLAttention
from moontrain.model.config import ModelConfig
from moontrain.model.documents import causal_attention, document_mask, flex_block_mask
from moontrain.model.experts import ExpertsContext
from moontrain.model.kda import layer as kda_module
from moontrain.model.kda.layer import KimiDeltaAttention, kda_fallback_warning
from moontrain.model.kda.ops import kda_gate
from moontrain.model.rope import rope_cos_sin
from moontrain.model.transformer import K3Model
from tests.moontrain.model.kda.test_ops import recurrent_kda

EOS = 63


def _cfg(**over) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=4, num_dense_layers=1, dense_intermediate_size=64,
                num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                use_nope=True, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=128,
                moe_latent_size=16, kda_layers_per_mla=1, kda_num_heads=3, kda_head_dim=8)
    return ModelConfig(**{**base, **over})


def _layer_reference(m: KimiDeltaAttention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    B, T, _ = x.shape
    H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size

    def conv(w_C1W: torch.Tensor, y_BTC: torch.Tensor) -> torch.Tensor:  # nn.Conv1d with causal padding
        y = F.conv1d(F.pad(y_BTC.transpose(1, 2), (W - 1, 0)), w_C1W, groups=w_C1W.shape[0])
        return F.silu(y.transpose(1, 2))

    def l2norm(y: torch.Tensor) -> torch.Tensor:  # fla's: eps 1e-6 under the root
        return y / (y.square().sum(-1, keepdim=True) + 1e-6).sqrt()

    q = l2norm(conv(m.q_conv1d, m.q_proj(x)).view(B, T, H, K))
    k = l2norm(conv(m.k_conv1d, m.k_proj(x)).view(B, T, H, K))
    v = conv(m.v_conv1d, m.v_proj(x)).view(B, T, H, K)
    f = m.f_proj(x) if cfg.kda_gate_rank is None else m.f_b_proj(m.f_a_proj(x))
    gate = m.g_proj(x) if cfg.kda_gate_rank is None else m.g_b_proj(m.g_a_proj(x))
    pre = f.view(B, T, H, K) + m.dt_bias.view(H, K)
    a = m.A_log.exp()[:, None]
    bound = cfg.kda_gate_lower_bound
    g = -a * F.softplus(pre) if bound is None else bound * torch.sigmoid(a * pre)
    beta = torch.sigmoid(m.b_proj(x))
    o = recurrent_kda(q, k, v, g, beta, K ** -0.5)
    o = F.rms_norm(o, (K,), m.o_norm.weight, cfg.norm_eps) * torch.sigmoid(gate.view(B, T, H, K))
    return m.o_proj(o.reshape(B, T, H * K))


@pytest.mark.parametrize(("rank", "bound"), [(None, -5.0), (6, None)], ids=["k3-gates", "kimi-linear-gates"])
def test_layer_matches_reference(rank: int | None, bound: float | None) -> None:
    cfg = _cfg(kda_gate_rank=rank, kda_gate_lower_bound=bound)
    m = KimiDeltaAttention(cfg).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    m.init_parameters(gen)
    x = torch.randn(2, 21, cfg.hidden_size, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(m(x), _layer_reference(m, x, cfg), rtol=1e-9, atol=1e-11)


def test_compile_turns_inductors_comprehensive_padding_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """KimiDeltaAttention.compile hands torch.compile options with comprehensive padding off (the GPU test
    test_layer_compile_gpu.py checks what that buys: no copies of the projection's slices), merged with the
    caller's options, which win."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    KimiDeltaAttention(_cfg()).compile()
    KimiDeltaAttention(_cfg()).compile(options={"max_autotune": True, "comprehensive_padding": True}, dynamic=False)
    assert calls == [{"options": {"comprehensive_padding": False}},
                     {"options": {"comprehensive_padding": True, "max_autotune": True}, "dynamic": False}]


def test_init_decay_rates_in_range() -> None:
    for bound in (-5.0, None):
        cfg = _cfg(kda_gate_lower_bound=bound)
        m = KimiDeltaAttention(cfg)
        m.init_parameters(torch.Generator().manual_seed(1))
        rate = -kda_gate(torch.zeros(1, 1, cfg.kda_heads, cfg.kda_head_dim), m.A_log, m.dt_bias, bound)
        assert rate.min() >= 1e-3 * (1 - 1e-4) and rate.max() <= 1e-1 * (1 + 1e-4), (rate.min(), rate.max())


def test_k3_layout() -> None:
    cfg = _cfg(num_layers=93, kda_layers_per_mla=3)
    mla = [i + 1 for i in range(93) if not cfg.layer_is_kda(i)]
    assert mla == [*range(4, 93, 4), 93]
    assert (cfg.num_kda_layers, cfg.num_mla_layers) == (69, 24)
    all_mla = _cfg(kda_layers_per_mla=0)
    assert not any(all_mla.layer_is_kda(i) for i in range(all_mla.num_layers))
    with pytest.raises(ValueError, match="kda_layers_per_mla"):
        _cfg(kda_layers_per_mla=-1)


def test_fla_kernel_needs_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kda_module, "fla_available", lambda: False)
    with pytest.raises(ValueError, match=r"kernels\.kda=fla needs fla-core"):
        KimiDeltaAttention(_cfg(), kernel="fla")


def test_auto_without_fla_on_a_gpu_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.kda=auto on CUDA without fla-core: the run is warned before its first step (the PyTorch KDA runs
    a recipe's batch out of memory); with fla, on the CPU, under kernels.kda=torch or with no KDA layer: not."""
    monkeypatch.setattr(kda_module, "fla_available", lambda: False)
    warning = kda_fallback_warning(_cfg(), "auto", "cuda")
    assert warning is not None and "fla-core is not installed" in warning and "kernels.kda=torch" in warning
    assert kda_fallback_warning(_cfg(), "auto", "cpu") is None
    assert kda_fallback_warning(_cfg(), "torch", torch.device("cuda", 0)) is None
    assert kda_fallback_warning(_cfg(kda_layers_per_mla=0), "auto", "cuda") is None
    monkeypatch.setattr(kda_module, "fla_available", lambda: True)
    assert kda_fallback_warning(_cfg(), "auto", "cuda") is None


def _model(cfg: ModelConfig, tokens: int) -> K3Model:
    model = K3Model(cfg, document_eos_id=EOS)
    model.init_weights(seed=0)
    model.attach_experts_backends("local", ExpertsContext(
        num_experts=cfg.num_experts, topk=cfg.num_experts_per_tok, ep_group=None, ep=1,
        compute_dtype=torch.float32, token_padding=8, max_tokens=tokens, device=torch.device("cpu")))
    return model


@pytest.mark.parametrize("use_nope", [True, False], ids=["nope", "rope"])
def test_documents_do_not_see_each_other(use_nope: bool) -> None:
    """Row 0: documents [0, 12) and [12, 70) (the second spans two KDA chunks); row 1: [0, 40), [40, 45),
    [45, 70). Changing row 0's first document and row 1's first two leaves the later logits bitwise equal."""
    cfg = _cfg(use_nope=use_nope, qk_rope_head_dim=4)
    gen = torch.Generator().manual_seed(3)
    T = 70
    tokens = torch.randint(0, EOS, (2, T), generator=gen)
    tokens[0, 11], tokens[1, 39], tokens[1, 44] = EOS, EOS, EOS
    model = _model(cfg, 2 * T)
    logits = model.logits(tokens).detach()
    changed = tokens.clone()
    changed[0, :11] = torch.randint(0, EOS, (11,), generator=gen)
    changed[1, :44] = torch.randint(0, EOS, (44,), generator=gen)
    changed[1, 39] = EOS  # the same boundaries, other contents
    changed_logits = model.logits(changed).detach()
    for row, start in ((0, 12), (1, 45)):
        assert torch.equal(changed_logits[row, start:], logits[row, start:]), f"row {row}: earlier document leaks"
        assert not torch.equal(changed_logits[row, :start], logits[row, :start])
    # the last document run alone, as its own row (MLA's rope is relative: positions shift, scores do not)
    alone = tokens[:1, 12:]
    ref = model.logits(alone).detach()[0]
    diff = (logits[0, 12:] - ref).abs().max().item()
    assert diff <= 1e-5 * ref.abs().max().item(), f"document alone vs packed: max |diff| {diff:.3g}"


def test_mla_masks_documents_like_flex_attention() -> None:
    """The CPU path (SDPA with a boolean mask) against flex_attention with the CUDA path's block mask (run
    eagerly on CPU here), and the MLA layer's masked output against per-document runs."""
    gen = torch.Generator().manual_seed(4)
    B, N, T = 2, 2, 40
    q, k = torch.randn(B, N, T, 12, generator=gen), torch.randn(B, N, T, 12, generator=gen)
    v = torch.randn(B, N, T, 8, generator=gen)
    tokens = torch.randint(0, EOS, (B, T), generator=gen)
    tokens[0, 10], tokens[1, 29] = EOS, EOS
    docs = document_mask(tokens, EOS)
    got = causal_attention(q, k, v, scale=0.3, docs=docs)
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        want = flex_attention(q, k, v, block_mask=flex_block_mask(docs.id_BT), scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    cfg = _cfg(use_nope=False)
    m = MLAttention(cfg)
    x = torch.randn(1, T, cfg.hidden_size, generator=gen)
    cos, sin = rope_cos_sin(T, cfg.qk_rope_head_dim, cfg.rope_theta, x.device)
    packed = m(x, cos, sin, document_mask(tokens[:1], EOS))
    first, second = m(x[:, :11], cos[:11], sin[:11]), m(x[:, 11:], cos[:29], sin[:29])
    torch.testing.assert_close(packed, torch.cat([first, second], 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", [None, 6], ids=["full-rank-gates", "low-rank-gates"])
def test_param_counts_and_flops_cover_kda(rank: int | None) -> None:
    from moontrain.metrics.flops import flops_per_token
    from moontrain.model.params import count_params

    cfg = _cfg(num_layers=8, kda_layers_per_mla=3, kda_gate_rank=rank)  # KDA 1-3, 5-7; MLA 4, 8
    D, H, K, W = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
    gates = 2 * D * H * K if rank is None else 2 * (D * rank + rank * H * K)
    per_kda = 3 * D * H * K + 3 * H * K * W + gates + D * H + H + H * K + H * K * D
    counts = count_params(cfg)
    assert (cfg.num_kda_layers, cfg.num_mla_layers) == (6, 2)
    assert counts.kda_attention == 6 * per_kda
    all_mla = count_params(_cfg(num_layers=8, kda_layers_per_mla=0))
    assert counts.attention - counts.kda_attention == 2 * all_mla.attention // 8
    # a KDA layer has its gated output norm (K) instead of MLA's q and kv latent norms
    assert counts.norms == all_mla.norms + 6 * (K - cfg.q_lora_rank - cfg.kv_lora_rank)
    # only the MLA layers' attention grows with the sequence: KDA is linear in it
    grow = flops_per_token(cfg, 2048) - flops_per_token(cfg, 1024)
    assert grow == 2 * 6 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 1024 / 2


def test_flat_sequence_bounds_open_a_sequence_at_every_row_and_document_start() -> None:
    """fla's cu_seqlens for the flattened batch: rows of 6 tokens, documents starting after the EOS at 1 (row 0)
    and at 0 and 4 (row 1: an EOS first opens a document at 1). Host and device copies agree; on the CPU a
    DocumentMask carries them only for a model whose KDA layers run fla."""
    from moontrain.model.documents import flat_sequence_bounds

    tokens = torch.tensor([[5, EOS, 7, 8, 9, 10], [EOS, 2, 3, 4, EOS, 6]])
    docs = document_mask(tokens, EOS)
    device_cu, host_cu = flat_sequence_bounds(docs.start_BT)
    assert host_cu.tolist() == [0, 2, 6, 7, 11, 12] and torch.equal(device_cu, host_cu)
    assert host_cu.dtype == torch.int64 and host_cu.device.type == "cpu"
    assert docs.seq_bounds is None
    with_bounds = document_mask(tokens, EOS, seq_bounds=True).seq_bounds
    assert torch.equal(with_bounds[0], device_cu) and torch.equal(with_bounds[1], host_cu)
    # from the host's copy of the ids (the loader's): the same bounds, no sync; a copy of another shape refused
    from_host = document_mask(tokens, EOS, seq_bounds=True, host_tokens_BT=tokens.clone()).seq_bounds
    assert torch.equal(from_host[0], device_cu) and torch.equal(from_host[1], host_cu)
    with pytest.raises(ValueError, match=r"host_tokens_BT \(1, 6\) must be tokens_BT's shape \(2, 6\)"):
        document_mask(tokens, EOS, seq_bounds=True, host_tokens_BT=tokens[:1])


def test_rope_table_is_made_once_per_length_and_equals_rope_cos_sin() -> None:
    """K3Model.rope_table: rope_cos_sin's values, built once per (length, device) (building it copies from the
    host: a sync per forward on CUDA otherwise)."""
    cfg = _cfg(num_layers=2)
    model = K3Model(cfg)
    cos, sin = model.rope_table(12, torch.device("cpu"))
    want = rope_cos_sin(12, cfg.qk_rope_head_dim, cfg.rope_theta, torch.device("cpu"), yarn=cfg.rope_yarn)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert model.rope_table(12, torch.device("cpu"))[0] is cos and model.rope_table(8, torch.device("cpu"))[0].shape[0] == 8


def test_fused_intra_stage_needs_the_gate_norm_route() -> None:
    """kernels.kda_intra=moontrain applies the norms' backward that only kda_gate_norm=moontrain leaves to it; with
    fla's ends the two would be applied twice or never: refused at config time, naming both fixes."""
    from moontrain.model.config import KernelsConfig

    assert KernelsConfig(kda_intra="moontrain", kda_gate_norm="moontrain").kda_intra == "moontrain"
    fixes = r"kda_intra=moontrain .* kernels.kda_gate_norm=moontrain .*'fla'.*kda_intra=fla_k64"
    with pytest.raises(ValueError, match=fixes):
        KernelsConfig(kda_intra="moontrain", kda_gate_norm="fla")


def test_one_kernel_walk_needs_the_gate_norm_route() -> None:
    """kernels.kda_walk=moontrain replaces two of the stages moontrain's KDA call runs; fla's chunk_kda has no
    place for it: refused at config time, naming both fixes; an unknown value likewise."""
    from moontrain.model.config import KernelsConfig

    assert KernelsConfig(kda_walk="moontrain").kda_walk == "moontrain" and KernelsConfig().kda_walk == "auto"
    assert KernelsConfig(kda_gate_norm="fla").kda_walk == "auto"  # auto: fla's kernels on fla's call
    with pytest.raises(ValueError, match=r"kda_walk=moontrain .* kernels.kda_gate_norm=moontrain .*'fla'.*kda_walk=fla"):
        KernelsConfig(kda_walk="moontrain", kda_gate_norm="fla")
    with pytest.raises(ValueError, match=r"kernels\.kda_walk must be 'auto', 'fla' or 'moontrain', got 'one'"):
        KernelsConfig(kda_walk="one")


def test_auto_intra_stage_is_the_fused_one_where_it_applies() -> None:
    """kernels.kda_intra=auto (the default) runs moontrain's fused intra+norm stage exactly where the config would
    accept kda_intra=moontrain and its kernel takes the gate (kda_gate_norm=moontrain, lower bound in [-10, 0):
    check_lower_bound's range, its edges included), and fla_k64 everywhere else, so no gate or ends are refused.
    Explicit values pass through unchanged."""
    from moontrain.model.config import KernelsConfig
    from moontrain.model.kda.intra_norm import check_lower_bound
    from moontrain.model.kda.layer import resolve_intra

    assert KernelsConfig().kda_intra == "auto"
    for bound in (-10.0, -5.0, -1e-6):
        check_lower_bound(bound)
        assert resolve_intra("auto", "moontrain", bound) == "moontrain"
        assert resolve_intra("auto", "fla", bound) == "fla_k64"
    for bound in (None, -10.5, -20.0):
        with pytest.raises(ValueError, match="kda_gate_lower_bound"):
            check_lower_bound(bound)
        assert resolve_intra("auto", "moontrain", bound) == "fla_k64"
    for intra in ("fla", "fla_k64", "moontrain"):
        assert resolve_intra(intra, "moontrain", -5.0) == intra
    with pytest.raises(ValueError, match="'auto', 'fla', 'fla_k64' or 'moontrain', got 'k64'"):
        KernelsConfig(kda_intra="k64")
