"""Bad input on one rank only (R = 2): every rank raises in the same call (the bad rank its own error,
the peer "another rank ... rejected its input"), nothing moves, and the next valid call on both ranks
is correct. Before the ranks agreed on the verdict, the bad rank raised alone, its peer waited in the
histogram exchange and the retry was paired with the peer's first call.

A plan made by another Buffer is refused by combine and dispatch(plan=).

Reference: reference_plan's rows for the valid retry (via test_bad_input._still_correct), bitwise.
"""

from __future__ import annotations

import re

import pytest

from moonep import Buffer, BufferConfig, BufferOptions
from tests.dist_utils import run_ranks
from tests.moonep.test_bad_input import PAD, E, H, K, S, _outcome, _reraise, _still_correct, _valid

PEER = r"another rank of the EP group rejected its input"


def _one_rank_bad(rank: int, world: int) -> dict[str, tuple[str | None, str]]:
    out: dict[str, tuple[str | None, str]] = {}
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD,
                              options=BufferOptions(timeout_s=30)))
    try:
        data = [_valid(6, seed=20 + r) for r in range(world)]
        x, w, topk, _ = data[rank]
        bad_topk = topk.clone()
        bad_topk[2, 1] = E  # an expert id outside [0, E), on rank 1 only
        out["dispatch: bad expert id on rank 1"] = _outcome(
            lambda: buf.dispatch(x, w, bad_topk if rank == 1 else topk))
        out["plan: bad topk shape on rank 0"] = _outcome(
            lambda: buf.plan(topk[:, :1].contiguous() if rank == 0 else topk))
        out["still correct"] = ("ok", _still_correct(buf, rank, [d[2] for d in data], [d[0] for d in data],
                                                      [d[1] for d in data], None))
    finally:
        buf.destroy()
    return out


EXPECTED = {
    "dispatch: bad expert id on rank 1": {0: PEER, 1: r"expert id"},
    "plan: bad topk shape on rank 0": {0: r"topk_sK", 1: PEER},
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[str | None, str]]]:
    return run_ranks(_one_rank_bad, 2, timeout_s=120)


@pytest.mark.parametrize("case", list(EXPECTED))
@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_raises_when_one_rank_rejects(outcomes: list[dict], rank: int, case: str) -> None:
    with pytest.raises(ValueError, match=EXPECTED[case][rank]):
        _reraise(outcomes[rank][case])


@pytest.mark.parametrize("rank", [0, 1])
def test_the_retry_is_correct_on_every_rank(outcomes: list[dict], rank: int) -> None:
    assert outcomes[rank]["still correct"] == ("ok", "ok")


def _foreign_plan(rank: int, world: int) -> dict[str, tuple[str | None, str]]:
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD,
                       options=BufferOptions(timeout_s=30))
    a, b = Buffer(cfg), Buffer(cfg)
    try:
        x, w, topk, _ = _valid(6, seed=3)
        res = a.dispatch(x, w, topk)
        b.dispatch(x, w, topk)
        return {"combine": _outcome(lambda: b.combine(res.plan, res.x_rows.clone())),
                "dispatch(plan=)": _outcome(lambda: b.dispatch(x, w, plan=res.plan)),
                "own plan still works": _outcome(lambda: a.combine(res.plan, res.x_rows.clone()))}
    finally:
        a.destroy()
        b.destroy()


def test_a_plan_of_another_buffer_is_refused() -> None:
    (out,) = run_ranks(_foreign_plan, 1, timeout_s=120)
    for call in ("combine", "dispatch(plan=)"):
        with pytest.raises(ValueError, match=rf"{re.escape(call.split('(')[0])} got a plan this Buffer did not make"):
            _reraise(out[call])
    assert out["own plan still works"] == (None, "")
