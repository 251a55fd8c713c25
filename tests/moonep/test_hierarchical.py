"""Hierarchical EP (moonep.hierarchical) on 2 "hosts" x 4 ranks (and 4 x 2: tokens with three and four
partial sums) over gloo equals the one-level result.

World 8 on one machine; each host group builds its own CPU symmetric heap over its 4 ranks, and rows
cross "hosts" through all-to-alls over the rail groups. The same 8 ranks also run the one-level layer
(one moonep Buffer over all 8), with the same expert weights at the same EP ranks:

- bitwise: route-weight grads of every token; y and grad_x of every token whose K experts lie on one
  host; y and grad_x of every token against the one-level group run once per host with the other hosts'
  entries absent (entries mode) and the partials summed in fp32 in ascending host order, which is the
  hierarchical summation order (moonep.hierarchical's docstring);
- weight grads: the same sums of the same bf16 products, but each expert's rows are grouped and split
  over ranks differently, so the fp32 summation order differs: within 2x the bf16 dense reference's own
  error to fp64 (plus 2 bf16 ulps of the largest value), as tests/moonep/test_moe_layer.py.

The routing is skewed (redundant experts inside each host, asserted) and a third of the tokens are forced
onto one host's experts (so both kinds of token are present, asserted). The problem and the three runs are
in tests/moonep/helpers/hierarchical_case.py (tests/moonep/test_hierarchical_multigpu.py runs them on 2 GPUs).
"""

from __future__ import annotations

import pytest
import torch

from moonep import Buffer, ExpertPools, glu_projections
from moonep.hierarchical import HierarchicalBuffer, hierarchical_expert_glu, host_groups
from tests.dist_utils import run_ranks
from tests.moonep.helpers.hierarchical_case import Case, check_rank, hosts_per_token, problem, run_case
from tests.moonep.helpers.moe_reference import reference_grads

BF16_EPS = 2.0**-8


def _rank_fn(rank: int, world: int, case: Case) -> dict:
    return run_case(rank, case, torch.device("cpu"))


def _close(name: str, got: torch.Tensor, ref16: torch.Tensor, ref64: torch.Tensor) -> None:
    err_ref = (ref16.double() - ref64).abs().max().item()
    tol = 2 * err_ref + 2 * BF16_EPS * ref64.abs().max().item()
    err = (got.double() - ref64).abs().max().item()
    assert err <= tol, f"{name}: max error {err:.3e} to fp64 exceeds {tol:.3e} (bf16 reference error {err_ref:.3e})"


@pytest.fixture(scope="module", params=[pytest.param(Case(R=8, N=2), marks=pytest.mark.slow),  # 8 ranks: slow
                                        pytest.param(Case(R=8, N=4), marks=pytest.mark.slow), Case(R=2, N=2)],
                ids=["2x4", "4x2", "2x1"])
def ranks(request: pytest.FixtureRequest) -> tuple[Case, list[dict]]:
    case = request.param
    return case, run_ranks(_rank_fn, case.R, case, timeout_s=300)


def test_hierarchical_equals_one_level_bitwise(ranks: tuple[Case, list[dict]]) -> None:
    case, outs = ranks
    _, _, topk, _, _ = problem(case)
    per_token = hosts_per_token(case, topk)
    assert (per_token == 1).any() and (per_token > 1).any(), "need one-host and multi-host tokens"
    if case.N > 2:
        assert (per_token > 2).any(), "need tokens on three or more hosts"
    for r, out in enumerate(outs):
        check_rank(case, r, out)
    if case.R > case.N:
        assert sum(o["host_slots"] for o in outs) > 0, "the skewed routing should need redundant experts in a host"


def test_hierarchical_weight_grads_match_reference(ranks: tuple[Case, list[dict]]) -> None:
    case, outs = ranks
    x, w, topk, weights, grad_y = problem(case)
    R, S, H, K = case.R, case.S, case.H, case.K
    args = (x.view(R * S, H), weights.view(R * S, K), topk.view(R * S, K), w, grad_y.view(R * S, H))
    _, _, _, gW16 = reference_grads(*args, torch.bfloat16)
    _, _, _, gW64 = reference_grads(*args, torch.float64)
    for p in w:
        for key in ("hier_g", "plain_g"):
            _close(f"{key} W_{p}", torch.cat([o[key][p] for o in outs]), gW16[p], gW64[p])


def test_host_groups_reject_a_group_that_does_not_split_into_hosts() -> None:
    with pytest.raises(ValueError, match="does not split into hosts of 4 ranks"):
        host_groups([list(range(6))], 4)
    with pytest.raises(ValueError, match="ranks_per_host must be >= 1"):
        host_groups([list(range(4))], 0)


def _bad_input(rank: int, world: int) -> list[str]:
    case = Case(R=1, N=1)
    host, rail = host_groups([[0]], 1)
    errors = []
    try:
        HierarchicalBuffer(case.config(entries=True), host, rail)
    except ValueError as err:
        errors.append(str(err))
    with HierarchicalBuffer(case.config(), host, rail) as hbuf, Buffer(case.config(), host) as other:
        pools = hbuf.make_pools(glu_projections(case.H, case.F))
        layer = pools.add_layer()
        x = torch.zeros(case.S, case.H, dtype=torch.bfloat16)
        w = torch.zeros(case.S, case.K)
        topk = torch.arange(case.K, dtype=torch.int32).repeat(case.S, 1)
        calls = [
            lambda: hierarchical_expert_glu(hbuf, ExpertPools(other, glu_projections(case.H, case.F)),
                                            layer, x, w, topk),
            lambda: hierarchical_expert_glu(hbuf, pools, layer, torch.zeros(case.S + 1, case.H), w, topk),
            lambda: hierarchical_expert_glu(hbuf, pools, layer, x, w, topk[:, :2]),
            lambda: hierarchical_expert_glu(hbuf, pools, layer, x, w, topk + case.E - 1),
        ]
        for call in calls:
            try:
                call()
            except ValueError as err:
                errors.append(str(err))
    return errors


def test_bad_input_is_a_value_error_naming_the_fix() -> None:
    errors = run_ranks(_bad_input, 1, timeout_s=120)[0]
    want = ["takes the EP group's one-level BufferConfig", "pools do not belong to this HierarchicalBuffer",
            "this call has s=25 tokens", "topk_sK must be int32/int64 of shape (24, 4)",
            "expert ids outside [0, 16)"]
    assert len(errors) == len(want), errors
    for got, text in zip(errors, want, strict=True):
        assert text in got, (text, got)
