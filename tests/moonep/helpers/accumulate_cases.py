"""One check of moonep.kernels.experts.accumulate_groups, shared by the interpreted test (CPU) and
the GPU test: empty groups are never read (NaN there) nor written, the rest is g + scale * w in fp32."""

from __future__ import annotations

import torch


def _case(rows_G: list[int], n_in: int, n_out: int, scale: float, device: str, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, offs, g, w, want = g + scale * w on groups with rows, g elsewhere); empty groups' w is NaN."""
    gen = torch.Generator(device=device).manual_seed(seed)
    G = len(rows_G)
    rows = torch.tensor(rows_G, device=device)
    offs = torch.cumsum(rows, 0).to(torch.int32)
    g = torch.randn(G, n_in, n_out, device=device, generator=gen)
    w = torch.randn(G, n_in, n_out, device=device, generator=gen).to(torch.bfloat16)
    w[rows == 0] = float("nan")  # an empty group's values must never be read
    want = g + w.float() * scale  # fp32 product, then the fp32 add
    want[rows == 0] = g[rows == 0]
    return rows, offs, g, w, want


def check_accumulate_groups(rows_G: list[int], n_in: int, n_out: int, scale: float, device: str) -> None:
    from moonep.kernels.experts import accumulate_groups

    rows, offs, g, w, want = _case(rows_G, n_in, n_out, scale, device, seed=1)
    accumulate_groups(g, w, offs, scale)
    if scale in (1.0, 0.5):  # exact products: bitwise
        assert torch.equal(g, want)
    else:
        # the GPU may fuse the multiply-add (one rounding of g + scale*w instead of two). Against the
        # exact value the two-rounding result errs by <= eps/2 (|scale*w| + |sum|) and the fused one
        # by <= eps/2 |sum|, so they differ by <= eps (|scale*w| + |sum|); with cancellation the
        # product's ulp dominates, not the sum's (a bound on the sum alone failed on the H200)
        assert torch.equal(g[rows == 0], want[rows == 0]), "an empty group was written"
        prod = (w.float() * scale).abs()
        tol = torch.finfo(torch.float32).eps * (prod + want.abs())
        tol[rows == 0] = 0
        err = (g - want).abs()
        assert bool((err <= tol).all()), f"accumulate differs by {float((err - tol).max()):.3e} beyond the bound"


def check_accumulate_groups_write(rows_G: list[int], write_groups: int, n_in: int, n_out: int, scale: float,
                                  device: str) -> None:
    """write_groups > 0: the first groups hold stale values (NaN here) and get exactly scale * w (one
    fp32 product), or +0 when empty; the others are accumulated as above (exact scales: bitwise)."""
    from moonep.kernels.experts import accumulate_groups

    rows, offs, g, w, want = _case(rows_G, n_in, n_out, scale, device, seed=2)
    want[:write_groups] = w[:write_groups].float() * scale
    want[:write_groups][rows[:write_groups] == 0] = 0.0
    g[:write_groups] = float("nan")  # stale: never read
    accumulate_groups(g, w, offs, scale, write_groups=write_groups)
    assert torch.equal(g, want)
    assert not torch.signbit(g[:write_groups][rows[:write_groups] == 0]).any()
