"""Checks of the fused expert GEMMs (moonep.kernels.grouped_glu, .grouped_wgrad) against exact fp64 values
and the PyTorch path (moonep.grouped_gemm, moonep.activation), shared by the interpreted (CPU) and GPU
tests.

Derived bounds (u = 2^-23, fp32's unit roundoff doubled so that a truncating accumulator is covered;
c = 2 for the tensor cores' block fused multiply-add, which aligns a block of products to the largest
before adding them, truncating: at most one more u of each block's largest term per block):
- h, u of the forward: an fp32 sum of H exact bf16 products (any order) is within c (H + 1) u sum|x w|
  of the exact dot product; rounding that to bf16 (nearest even) adds at most 2^-8 of the value:
  |h - exact| <= 2^-8 |exact| + (1 + 2^-8) c (H + 1) u sum|x w| (+ 2^-133, bf16's subnormal spacing).
  The PyTorch path (torch._grouped_mm) obeys the same bound, so the two are within twice of each other.
- a of the forward: f of the returned (bf16) h and u with the activation kernel's own code, so bitwise
  equal to that kernel on them (moonep.kernels.swiglu / .situ_glu), and within the activation's tested
  bound of its PyTorch specification (swiglu: 2 bf16 ulps; situ_glu: tests/moonep/helpers/situ_glu_cases.py).
- the weight gradient, per group of n rows: n exact products summed in fp32, one multiply by scale,
  one add to g: |got - exact| <= c (n + 3) u (|scale| sum|x d| + |g|). The PyTorch path obeys it on the
  CPU (fp32 product); on CUDA it rounds the product to bf16 first: 2^-8 |scale| sum|x d| more.
"""

from __future__ import annotations

import torch

U = 2.0**-23
C = 2  # block fused multiply-add (see above)


def _offs(rows_G: list[int], device: str) -> torch.Tensor:
    return torch.cumsum(torch.tensor(rows_G, device=device), 0).to(torch.int32)


def _rows(rows_G: list[int], width: int, pad: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """bf16 [sum(rows) + pad, width]; the padding rows past offs[-1] are NaN (never to be read)."""
    x = torch.randn(sum(rows_G) + pad, width, device=device, generator=gen).to(torch.bfloat16)
    x[sum(rows_G):] = float("nan")
    return x


def _group_slices(rows_G: list[int]) -> list[slice]:
    ends = torch.cumsum(torch.tensor(rows_G), 0).tolist()
    return [slice(e - r, e) for r, e in zip(rows_G, ends, strict=True)]


def _assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    diff = (got.double() - want.double()).abs()
    bad = (~(diff <= bound)).nonzero()  # NaN counts as bad
    assert bad.numel() == 0, (f"{name}: {bad.shape[0]} of {got.numel()} elements off, first at "
                              f"{tuple(bad[0].tolist())}: got {float(got[tuple(bad[0])])}, want "
                              f"{float(want[tuple(bad[0])])}, bound {float(bound[tuple(bad[0])]):.3g}")


def _assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert bad.numel() == 0, (f"{name}: {bad.shape[0]} elements differ, first at {tuple(bad[0].tolist())}: "
                              f"{float(got[tuple(bad[0])])} vs {float(want[tuple(bad[0])])}")


def check_grouped_glu(rows_G: list[int], H: int, F: int, activation: str, device: str, seed: int = 0,
                      torch_path: bool = True) -> None:
    """torch_path False: against exact values only (torch._grouped_mm on CUDA wants groups of multiples of
    8 rows)."""
    from moonep import merge_gate_up
    from moonep.activation import get_activation
    from moonep.grouped_gemm import grouped_mm
    from moonep.kernels.glu_rows import glu_forward_rows
    from moonep.kernels.grouped_glu import grouped_glu_forward
    from tests.moonep.helpers.situ_glu_cases import assert_close_to_exact, exact

    gen = torch.Generator(device=device).manual_seed(seed)
    G = len(rows_G)
    x = _rows(rows_G, H, 5, device, gen)
    w_gate = (torch.randn(G, H, F, device=device, generator=gen) * H**-0.5).to(torch.bfloat16)
    w_up = (torch.randn(G, H, F, device=device, generator=gen) * H**-0.5).to(torch.bfloat16)
    w_gate_up = merge_gate_up(w_gate, w_up)
    offs = _offs(rows_G, device)
    n = sum(rows_G)

    a, hu = grouped_glu_forward(x, w_gate_up, offs, activation)
    a, hu = a[:n], hu[:n]
    h, u = hu[:, :F], hu[:, F:]
    for name, got, w in (("h", h, w_gate), ("u", u, w_up)):
        want = torch.cat([x[s].double() @ w[g].double() for g, s in enumerate(_group_slices(rows_G))])
        mag = torch.cat([x[s].double().abs() @ w[g].double().abs() for g, s in enumerate(_group_slices(rows_G))])
        bound = 2.0**-8 * want.abs() + (1 + 2.0**-8) * C * (H + 1) * U * mag + 2.0**-133
        _assert_within(f"{name} vs exact", got, want, bound)
        if torch_path:
            ref = grouped_mm(x, w, offs)[:n]
            _assert_within(f"{name} vs torch._grouped_mm", got, ref, 2 * bound)

    _assert_bitwise("a vs the activation kernel on hu", a, glu_forward_rows(activation, hu.contiguous()))
    spec = get_activation(activation).forward(h, u)
    if activation == "situ_glu":
        assert_close_to_exact("a", a, exact(torch.ones_like(h), h, u)["a"])
    else:  # silu rounded, then the product: two roundings on either side
        bound = torch.maximum(a.float().abs(), spec.float().abs()) * 2 * 2.0**-7
        _assert_within("a vs F.silu(h) * u", a, spec, bound.double())

    a_only, hu_none = grouped_glu_forward(x, w_gate_up, offs, activation, save_preact=False)
    assert hu_none is None
    _assert_bitwise("a without saving hu", a_only[:n], a)


def check_grouped_wgrad(rows_G: list[int], I: int, O: int, scale: float, write_groups: int, device: str,
                        seed: int = 0, torch_path: bool = True) -> None:
    from moonep.grouped_gemm import accumulate_wgrad
    from moonep.kernels.grouped_wgrad import grouped_wgrad_accumulate

    gen = torch.Generator(device=device).manual_seed(seed)
    G = len(rows_G)
    x = _rows(rows_G, I, 3, device, gen)
    d = _rows(rows_G, O, 3, device, gen)
    offs = _offs(rows_G, device)
    g0 = torch.randn(G, I, O, device=device, generator=gen)
    g0[:write_groups] = float("nan")  # stale: never to be read
    g = g0.clone()
    grouped_wgrad_accumulate(g, x, d, offs, scale, write_groups)

    # the PyTorch path (moonep.datapath.reference.accumulate_wgrad)
    ref = g0.clone()
    ref[:write_groups].zero_()
    if torch_path:
        accumulate_wgrad(ref, x[:sum(rows_G)], d[:sum(rows_G)], offs, scale)

    for grp, (rows, s) in enumerate(zip(rows_G, _group_slices(rows_G), strict=True)):
        base = torch.zeros_like(g0[grp]) if grp < write_groups else g0[grp]
        if rows == 0:
            if grp < write_groups:
                assert torch.equal(g[grp], torch.zeros_like(g[grp])) and not torch.signbit(g[grp]).any(), \
                    f"group {grp}: an empty stale group must be written with +0"
            else:
                assert torch.equal(g[grp], g0[grp]), f"group {grp}: an empty group was written"
            continue
        xs, ds = x[s].double(), d[s].double()
        want = base.double() + scale * (xs.t() @ ds)
        mag = abs(scale) * (xs.abs().t() @ ds.abs()) + base.double().abs()
        bound = C * (rows + 3) * U * mag + 2.0**-140
        _assert_within(f"group {grp} ({rows} rows) vs exact", g[grp], want, bound)
        bf16_product = 2.0**-8 * (1 + C * (rows + 1) * U) * abs(scale) * (xs.abs().t() @ ds.abs()) if ref.is_cuda else 0.0
        if torch_path:
            _assert_within(f"group {grp} ({rows} rows) vs the PyTorch path", g[grp], ref[grp], 2 * bound + bf16_product)
