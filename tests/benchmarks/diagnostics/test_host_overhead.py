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


def test_op_sites_count_one_op_in_every_region_with_its_output() -> None:
    """--op: the named op's calls in compiled and eager regions alike, keyed by phase, region, output shape and
    dtype and call site; autograd's sum of two grads of one tensor is an add of the autograd engine's."""
    regions = Regions()
    with regions.standing_in():
        region = torch.compile(lambda x: x + 1, dynamic=False)
    x = torch.randn(3, 2, requires_grad=True)
    counter = OpCounter(regions, sites=True, op="add")
    with counter:
        y = region(x)  # compiled add
        (y * x).sum().backward()  # x has two consumers (the region and the mul): its grads are summed
    sites = dict(counter.op_sites)
    # the compiled add, and autograd's sum of x's two grads (run while the region's AddBackward0 node is current,
    # so counted in the compiled region, as the backward of the region's nodes is)
    assert sum(sites.values()) == 2 and all(k.startswith("step     compiled    (3, 2) float32") for k in sites), sites
    assert sum(n for k, n in sites.items() if k.endswith("autograd AddBackward0")) == 1, sites
