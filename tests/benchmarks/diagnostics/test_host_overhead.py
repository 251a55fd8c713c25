"""host_overhead's counter: ops inside a stood-in torch.compile region, and the backward of the autograd
nodes they created, are counted apart from the eager ones (the run itself is the benchmark)."""

from __future__ import annotations

import torch

from benchmarks.diagnostics.host_overhead import OpCounter, Regions


def test_compiled_regions_and_their_backward_are_counted_apart() -> None:
    regions = Regions()
    compile_ = torch.compile
    with regions.standing_in():
        region = torch.compile(lambda x: (x * 2).sin(), dynamic=False)
    assert torch.compile is compile_, "the stand-in must be undone"
    x = torch.randn(4, requires_grad=True)
    counter = OpCounter(regions, sites=True)
    with counter:
        y = region(x)  # compiled: mul, sin; backward: cos, mul (SinBackward), mul (MulBackward)
        (y + 1).exp().sum().backward()  # eager: add, exp, sum; backward: ones_like, expand, mul (ExpBackward)
    assert dict(counter.by_region) == {"compiled step": 5, "eager step": 9}, dict(counter.by_region)
    assert counter.ops["mul"] == 1 and counter.ops["exp"] == 1 and counter.ops["add"] == 1, dict(counter.ops)
    assert counter.launching == 5, "views and detach launch nothing; add, exp, sum, ones_like, mul do"
    assert regions.calls == {"compiled": 1}
    torch.testing.assert_close(x.grad, (torch.cos(2 * x) * 2 * torch.exp(torch.sin(2 * x) + 1)).detach())
