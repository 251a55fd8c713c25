"""One check of moonep.kernels.experts.accumulate_groups, shared by the interpreted test (CPU) and
the GPU test: empty groups are never read (NaN there) nor written, the rest is g + scale * w in fp32."""

from __future__ import annotations

import torch


def check_accumulate_groups(rows_G: list[int], n_in: int, n_out: int, scale: float, device: str) -> None:
    from moonep.kernels.experts import accumulate_groups

    gen = torch.Generator(device=device).manual_seed(1)
    G = len(rows_G)
    rows = torch.tensor(rows_G, device=device)
    offs = torch.cumsum(rows, 0).to(torch.int32)
    g = torch.randn(G, n_in, n_out, device=device, generator=gen)
    w = torch.randn(G, n_in, n_out, device=device, generator=gen).to(torch.bfloat16)
    w[rows == 0] = float("nan")  # an empty group's values must never be read
    want = g + w.float() * scale  # fp32 product, then the fp32 add
    want[rows == 0] = g[rows == 0]
    accumulate_groups(g, w, offs, scale)
    if scale in (1.0, 0.5):  # exact products: bitwise
        assert torch.equal(g, want)
    else:  # the GPU may fuse the multiply-add (one rounding instead of two): within 1 fp32 ulp
        ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=torch.finfo(torch.float32).tiny)
        assert bool(((g - want).abs() <= ulp).all()) and torch.equal(g[rows == 0], want[rows == 0])
