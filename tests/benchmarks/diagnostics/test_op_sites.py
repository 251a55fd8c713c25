"""op_sites' recorder: the chosen ops' large outputs with their inputs and call sites (the run itself is the
diagnostic)."""

from __future__ import annotations

import torch

from benchmarks.diagnostics.op_sites import CompiledOpSites, OpSites


def _scaled_copy(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous() * 2  # a clone of a strided input, from this frame (not moontrain's)


def test_records_the_chosen_ops_above_the_size_with_inputs_and_the_autograd_node() -> None:
    x = torch.randn(64, 32, requires_grad=True)
    mode = OpSites({"clone", "_to_copy"}, min_elements=1024)
    with mode:
        y = _scaled_copy(x)  # clone [32, 64] float32 from a non-contiguous input
        small = torch.randn(4, 4).to(torch.float64)  # _to_copy below the size: not recorded
        (y.to(torch.float64).sum() + small.sum()).backward()  # _to_copy [32, 64] and its backward's _to_copy
    keys = {(k[0], k[1], k[2], k[3]): n for k, n in mode.calls.items()}
    assert keys[("clone", (32, 64), "float32", str((((32, 64), "float32", False),)))] == 1, keys
    assert keys[("_to_copy", (32, 64), "float64", str((((32, 64), "float32", True),)))] == 1, keys
    assert keys[("_to_copy", (32, 64), "float32", str((((32, 64), "float64", False),)))] == 1, keys  # sum's expand
    assert all(k[1] != (4, 4) for k in mode.calls), "outputs below min_elements are left out"
    backward_sites = [k[4] for k in mode.calls if k[2] == "float32" and k[0] == "_to_copy"]
    assert backward_sites == ["autograd ToCopyBackward0"], backward_sites
    assert all(mode.bytes[k] == 32 * 64 * (8 if k[2] == "float64" else 4) * n for k, n in mode.calls.items())


def _doubled_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x]) + 1


def _tripled_rows(x: torch.Tensor) -> torch.Tensor:  # another code object: dynamo's skip is per code object
    return torch.cat([x, x, x]) + 1


def test_compiled_variant_lets_compiled_graphs_run_compiled() -> None:
    """Compiled outside any mode first (op_sites' warm-up pass), then run under the recorder: CompiledOpSites
    (op_sites --compile) leaves the graph compiled, whose generated code calls no aten cat; OpSites makes
    torch.compile fall back to eager, so the cat is recorded."""
    x = torch.randn(64, 32)
    for fn, mode_type, recorded in ((_doubled_rows, CompiledOpSites, 0), (_tripled_rows, OpSites, 1)):
        compiled = torch.compile(fn, dynamic=False)
        compiled(x)
        mode = mode_type({"cat"}, min_elements=1024)
        with mode:
            got = compiled(x)
        assert torch.equal(got, fn(x))
        cats = sum(n for k, n in mode.calls.items() if k[0] == "cat")
        assert cats == recorded, f"{mode_type.__name__}: {cats} cat calls recorded, want {recorded}"
