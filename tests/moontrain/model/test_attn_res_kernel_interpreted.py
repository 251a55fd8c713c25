"""moontrain.model.attn_res_kernel in Triton's interpreter on the CPU: h, r, p and every gradient against the
specification (attn_res.depth_forward / depth_backward) evaluated in float64 on the same values.

Bounds. fp32 values: every output is a short chain of fp32 stages (two D-term row sums, a softmax over N, an
N-term weighted sum; in backward two more D-term sums and the dq sum over rows and values). A k-term fp32 sum
is within k u of its exact value relative to the sum of magnitudes (u = 2^-24, Higham's gamma_k), and the
stages add such errors, so each output is within c (D + N) u of the float64 result relative to its largest
magnitude, with c = 16 covering the chain's few stages and the magnitude sums (the tests' values are O(1));
dq sums over all M rows as well: (D + N + M) u. bf16 values: the outputs are cast once to bf16 on top of
that, which on the GPU rounds to nearest (2^-8 relative) and in the interpreter truncates (up to one bf16 ulp,
2^-7 relative): 2^-7.
"""

from __future__ import annotations

import pytest
import torch

# first: sets TRITON_INTERPRET=1 before triton is imported and skips this module where triton is absent
import tests.moonep.helpers.triton_interpreted  # noqa: F401
from moontrain.model import attn_res, attn_res_kernel
from moontrain.model.attn_res import DepthAttention

U32 = 2.0**-24


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns in smaller tiles than the GPU's: D = 40 over three column blocks of 16 (the last partial); 3 x 7
    = 21 rows over six row blocks of 4 (the last partial; the GPU's tile takes one row a block)."""
    monkeypatch.setattr(attn_res_kernel, "BLOCK_D", 16)
    monkeypatch.setattr(attn_res_kernel, "BLOCK_M", 4)


def _inputs(N: int, dtype: torch.dtype, D: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    values = tuple((torch.randn(3, 7, D, generator=g) * (1 + 0.5 * i)).to(dtype) for i in range(N))
    query = torch.randn(D, generator=g)
    key_weight = 1 + 0.3 * torch.randn(D, generator=g)
    grad_h = torch.randn(3, 7, D, generator=g).to(dtype)
    return query, key_weight, values, grad_h


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    diff = (got.double() - want.double()).abs().max().item()
    tol = rel * max(want.abs().max().item(), 1.0)
    assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def _spec64(query, key_weight, eps, values, grad_h):
    v64 = tuple(v.double() for v in values)
    h, r, p = attn_res.depth_forward(query.double(), key_weight.double(), eps, v64)
    gq, gw, gv = attn_res.depth_backward(query.double(), key_weight.double(), r, p, grad_h.double(), v64)
    return h, r, p, gq, gw, gv


@pytest.mark.parametrize(("N", "dtype"), [(1, torch.float32), (2, torch.float32), (4, torch.float32),
                                          (5, torch.float32), (3, torch.bfloat16)])
def test_kernels_match_spec(N: int, dtype: torch.dtype, small_blocks: None) -> None:
    query, key_weight, values, grad_h = _inputs(N, dtype, seed=N)
    eps = 1e-6
    h, r, p = attn_res_kernel.depth_forward(query, key_weight, eps, values)
    gq, gw, gv = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values)
    want = _spec64(query, key_weight, eps, values, grad_h)
    D, M = values[0].shape[-1], values[0].numel() // values[0].shape[-1]
    rel = 16 * (D + N) * U32 + (2.0**-7 if dtype == torch.bfloat16 else 0.0)
    rel_q = 16 * (D + N + M) * U32
    assert h.dtype == dtype and all(g.dtype == dtype for g in gv)
    assert r.shape == p.shape == (N, 3, 7)
    _close("h", h, want[0], rel)
    _close("r", r, want[1], 16 * D * U32)
    _close("p", p, want[2], rel)
    _close("grad query", gq, want[3], rel_q)
    _close("grad key weight", gw, want[4], rel_q)
    for i, (a, b) in enumerate(zip(gv, want[5], strict=True)):
        _close(f"grad value {i}", a, b, rel)


@pytest.mark.parametrize("N", [3, 4])
def test_gpu_tiles_match_spec(N: int) -> None:
    """The GPU's tile sizes: D = 2100 over two column blocks of 2048 (the second partial), 21 rows in one-row
    blocks, below and from BWD_MANY_N values (the backward's program counts differ there; here both exceed 21)."""
    assert (attn_res_kernel.BLOCK_M, attn_res_kernel.BLOCK_D) == (1, 2048), "the shipped tile changed: adapt D"
    assert attn_res_kernel.BWD_MANY_N == 4
    D = 2100
    query, key_weight, values, grad_h = _inputs(N, torch.float32, D=D, seed=7)
    h, r, p = attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    gq, gw, gv = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values)
    want = _spec64(query, key_weight, 1e-6, values, grad_h)
    rel = 16 * (D + N) * U32
    for name, a, b in (("h", h, want[0]), ("p", p, want[2]), ("grad value 2", gv[2], want[5][2])):
        _close(name, a, b, rel)
    _close("grad query", gq, want[3], 16 * (D + N + 21) * U32)
    _close("grad key weight", gw, want[4], 16 * (D + N + 21) * U32)


@pytest.mark.parametrize(("param_dtype", "block_m", "N"), [(torch.float32, 4, 3), (torch.bfloat16, 4, 3),
                                                            (torch.float32, 1, 3), (torch.float32, 1, 4)])
def test_programs_walking_several_row_blocks_match_spec(param_dtype: torch.dtype, block_m: int, N: int,
                                                        small_blocks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most BWD_PROGRAMS backward programs: with 5 for the 6 row blocks of 4 rows, program 0 walks blocks 0 and
    5 (its dq partial summed over both, the last block partial) and the others one; with one-row blocks (the GPU's)
    program 0 walks rows 0, 5, 10, 15 and 20. The parameters' kernel reads the 5 partials in tiles of 2 (the last
    partial) and columns in tiles of 16 (D = 40: the last partial). The parameters in param_dtype: their gradients
    come back in it, each rounded once (bf16: 2^-7 in the interpreter, above the fp32 bound). N = 4 takes its count
    from BWD_PROGRAMS_MANY (set to 5 too)."""
    monkeypatch.setattr(attn_res_kernel, "BLOCK_M", block_m)
    monkeypatch.setattr(attn_res_kernel, "BWD_PROGRAMS", 5 if N < attn_res_kernel.BWD_MANY_N else 1000)
    monkeypatch.setattr(attn_res_kernel, "BWD_PROGRAMS_MANY", 5 if N >= attn_res_kernel.BWD_MANY_N else 1000)
    monkeypatch.setattr(attn_res_kernel, "PARAM_PARTS", 2)
    monkeypatch.setattr(attn_res_kernel, "PARAM_COLS", 16)
    partials = []  # the partials' count the parameters' kernel sums: the backward's programs
    real = attn_res_kernel._param_grad_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                partials.append(args[5])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attn_res_kernel, "_param_grad_kernel", Spy())
    query, key_weight, values, grad_h = _inputs(N, torch.float32, seed=17)
    query, key_weight = query.to(param_dtype), key_weight.to(param_dtype)
    _, r, p = attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    gq, gw, gv = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values)
    want = _spec64(query, key_weight, 1e-6, values, grad_h)
    assert partials == [5], f"the backward ran {partials} programs, not its count for N = {N}"
    assert gq.dtype == gw.dtype == param_dtype
    rel_q = 16 * (40 + N + 21) * U32 + (2.0**-7 if param_dtype == torch.bfloat16 else 0.0)
    _close("grad query", gq, want[3], rel_q)
    _close("grad key weight", gw, want[4], rel_q)
    for i, (a, b) in enumerate(zip(gv, want[5], strict=True)):
        _close(f"grad value {i}", a, b, 16 * (40 + N) * U32)


def test_more_values_than_the_kernel_takes_run_the_spec(small_blocks: None) -> None:
    """N > MAX_VALUES: the kernels refuse it, and the math the module takes from attn_res.triton_math gives the
    specification's own results, bit for bit."""
    N = attn_res_kernel.MAX_VALUES + 1
    query, key_weight, values, grad_h = _inputs(N, torch.float32, D=8, seed=3)
    with pytest.raises(ValueError, match=rf"the AttnRes kernels take 1 to {N - 1} values, got {N}"):
        attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    fwd, bwd = attn_res.triton_math()
    got = fwd(query, key_weight, 1e-6, values)
    want = attn_res.depth_forward(query, key_weight, 1e-6, values)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    got_b = bwd(query, key_weight, got[1], got[2], grad_h, values)
    want_b = attn_res.depth_backward(query, key_weight, want[1], want[2], grad_h, values)
    assert torch.equal(got_b[0], want_b[0]) and torch.equal(got_b[1], want_b[1])
    assert all(torch.equal(a, b) for a, b in zip(got_b[2], want_b[2], strict=True))


def test_module_with_triton_kernel_matches_torch_math(small_blocks: None) -> None:
    """DepthAttention(kernel="triton") through autograd: h and the grads of the values, the pseudo-query and
    the key-norm weight against the module with the PyTorch math (kernels.attn_res=torch)."""
    query, key_weight, values, grad_h = _inputs(3, torch.float32, seed=11)
    outs = []
    for kernel in ("torch", "triton"):
        m = DepthAttention(40, kernel=kernel)
        assert (m.math is attn_res.EAGER) == (kernel == "torch")
        with torch.no_grad():
            m.query.copy_(query)
            m.key_norm.weight.copy_(key_weight)
        vals = [v.clone().requires_grad_() for v in values]
        h = m(tuple(vals[:-1]), vals[-1])
        grads = torch.autograd.grad(h, [*vals, m.query, m.key_norm.weight], grad_h)
        outs.append((h, *grads))
    rel = 16 * (40 + 3 + 21) * U32
    for i, (a, b) in enumerate(zip(outs[1], outs[0], strict=True)):
        _close(f"output {i}", a, b, rel)


def test_values_of_different_shapes_are_refused() -> None:
    query, key_weight, values, _ = _inputs(2, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"AttnRes values must share shape, dtype and device: \(3, 7, 40\)"):
        attn_res_kernel.depth_forward(query, key_weight, 1e-6, (values[0], values[1][:, :5]))


def test_parameters_read_in_place_must_be_contiguous_vectors() -> None:
    """The kernels read the pseudo-query and the key-norm weight themselves (q = query * key_weight in fp32)."""
    query, key_weight, values, _ = _inputs(2, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"contiguous float query of \[40\], got \(20,\)"):
        attn_res_kernel.depth_forward(query[::2], key_weight, 1e-6, values)
    with pytest.raises(ValueError, match=r"contiguous float key_weight of \[40\], got \(40,\) torch.int64"):
        attn_res_kernel.depth_forward(query, key_weight.long(), 1e-6, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_sums_into_the_given_gradients(dtype: torch.dtype, small_blocks: None) -> None:
    """into (attn_res.BlockGrad's sums): value n's gradient is added to into[n] in place, in fp32 before the one
    rounding, and into[n] is the value's entry; a value without one gets a new tensor. Bound: the gradient's
    (as in test_kernels_match_spec) relative to the sum's largest entry, plus one rounding of the sum."""
    query, key_weight, values, grad_h = _inputs(3, dtype, seed=13)
    g = torch.Generator().manual_seed(14)
    into = [torch.randn(values[0].shape, generator=g).to(dtype), None,
            torch.randn(values[0].shape, generator=g).to(dtype)]
    before = [None if t is None else t.clone() for t in into]
    _, r, p = attn_res_kernel.depth_forward(query, key_weight, 1e-6, values)
    _, _, gv = attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values, into)
    want = _spec64(query, key_weight, 1e-6, values, grad_h)[5]
    assert gv[0] is into[0] and gv[2] is into[2] and gv[1] is not None and gv[1].dtype == dtype
    rel = 16 * (40 + 3) * U32 + (2.0**-7 if dtype == torch.bfloat16 else 0.0)
    for i in range(3):
        base = 0 if before[i] is None else before[i].double()
        _close(f"grad value {i}", gv[i], want[i] + base, rel)
    with pytest.raises(ValueError, match=r"an AttnRes gradient sum must be contiguous with its value's shape and dtype"):
        attn_res_kernel.depth_backward(query, key_weight, r, p, grad_h, values, [None, None, into[0].double()])


def test_model_with_triton_kernels_matches_torch_math(small_blocks: None) -> None:
    """The K3 block (KDA and MLA, MoE, AttnRes blocks of 4 sub-layers read by up to eleven aggregations, summing
    their gradients in the kernel's store): every parameter's gradient with kernels.attn_res=triton against
    the PyTorch math, fp32. Bound: the aggregations' fp32 reordering (16 (D + N + M) u each, as above) carried
    through the model's few layers: 1e-4 relative to each gradient's largest entry."""
    from moontrain.model.config import KernelsConfig
    from tests.moontrain.model.test_attn_res import _cfg, _model, param_grads

    cfg = _cfg(attn_res_block_size=4, kda_layers_per_mla=1, kda_head_dim=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    runs = [param_grads(_model(cfg, KernelsConfig(attn_res=kernel)), tokens) for kernel in ("torch", "triton")]
    for name, want in runs[0].items():
        got = runs[1][name]
        assert (got is None) == (want is None), name
        if want is not None:
            diff, tol = (got - want).abs().max().item(), 1e-4 * want.abs().max().item()
            assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"
