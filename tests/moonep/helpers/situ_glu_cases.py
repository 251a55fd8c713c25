"""SiTU-GLU test inputs and the exact (fp64) values with a derived error bound, shared by the CPU,
interpreter and GPU tests of moonep.activation's SiTU-GLU and moonep.kernels.situ_glu.

Bound per output element: rounding the fp32 result to bf16 costs at most half a bf16 ulp
(2^-8 |exact|; 2^-24 for fp32 outputs); the fp32 evaluation (about 15 roundings, exp within a few ulps on every backend)
is off by well under 2^-18 times the magnitude of the terms it sums (`scale`: |exact| for the pure
products a and grad_u; for grad_h, whose factor situ'(h) is a sum of two terms that cancel near the
minimum of situ, |grad_a cap| times the sum of the two terms' magnitudes), and that error can move
the rounding to the neighbouring bf16 value; and below fp32's normal range (sigmoid's tail under 2^-126,
times factors under 4 * 25 * |grad_a|) values underflow to 0: bound = 2^-8 |exact| + 2^-17 scale + 2^-110.
"""

from __future__ import annotations

import torch


def situ_inputs(seed: int, N: int = 67, F: int = 300, device: str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 h, u, grad_a covering the Taylor range (|h/4|, |u/25| < 1/16), both caps' saturation (|h| up
    to ~400, |u| up to ~1000), sigmoid's tails and exact zeros; N, F not multiples of a kernel block."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-4, 3, (N, F), generator=g).float()
    h = (torch.randn(N, F, generator=g) * scale).to(torch.bfloat16)
    u = (torch.randn(N, F, generator=g) * scale.flip(0)).to(torch.bfloat16)
    h[0, :8] = 0.0
    u[1, :8] = 0.0
    grad_a = torch.randn(N, F, generator=g).to(torch.bfloat16)
    return h.to(device), u.to(device), grad_a.to(device)


def exact(grad_a: torch.Tensor, h: torch.Tensor, u: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (exact fp64 value, error scale) for a, grad_h, grad_u (textbook formulas in fp64 with
    torch's tanh, cosh and sigmoid: independent of the implementation under test)."""
    hd, ud, gd = h.double().cpu(), u.double().cpu(), grad_a.double().cpu()
    t, sig, c = torch.tanh(hd / 4), torch.sigmoid(hd), torch.tanh(ud / 25)
    situ, cap = 4 * t * sig, 25 * c
    term1, term2 = sig / torch.cosh(hd / 4) ** 2, 4 * t * sig * torch.sigmoid(-hd)  # no 1 - (~1) cancellation
    a = situ * cap
    grad_h = gd * cap * (term1 + term2)
    grad_u = gd * situ / torch.cosh(ud / 25) ** 2
    return {"a": (a, a.abs()), "grad_h": (grad_h, (gd * cap).abs() * (term1.abs() + term2.abs())),
            "grad_u": (grad_u, grad_u.abs())}


def assert_close_to_exact(name: str, got: torch.Tensor, want_scale: tuple[torch.Tensor, torch.Tensor]) -> None:
    want, scale = want_scale
    assert got.dtype in (torch.bfloat16, torch.float32) and got.shape == want.shape
    half_ulp = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-24
    diff = (got.double().cpu() - want).abs()
    bound = half_ulp * want.abs() + 2.0**-17 * scale + 2.0**-110
    bad = (diff > bound).nonzero()
    assert bad.numel() == 0, (f"{name}: {bad.shape[0]} elements off, first at {tuple(bad[0].tolist())}: got "
                              f"{float(got[tuple(bad[0])])}, exact {float(want[tuple(bad[0])])}, "
                              f"bound {float(bound[tuple(bad[0])]):.3g}")


def assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert bad.numel() == 0, (f"{name}: {bad.shape[0]} elements differ, first at {tuple(bad[0].tolist())}: "
                              f"{float(got[tuple(bad[0])])} vs {float(want[tuple(bad[0])])}")
