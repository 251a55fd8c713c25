"""Bad input (docs/moonep.md §8): every public entry point raises ValueError naming the offending value.

The single-rank cases run in one spawn of a gloo group of 1, the cross-rank cases (E % R, s
differing across ranks, a wrong total_num_tokens) in one spawn of 2 ranks. Each rank records the
outcome of every case as (exception type, message); the parent re-raises it under
`pytest.raises(ValueError, match=...)`, one test per case. After all the errors, a valid dispatch
and combine on the same buffer must still give the reference rows (a rejected call corrupts
nothing).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools, expert_glu, glu_projections, make_plan
from moonep.layout import Layout
from tests.dist_utils import run_ranks
from tests.moonep.helpers.planner_reference import reference_plan

S, H, K, E, PAD = 8, 32, 2, 4, 4


def _outcome(fn: Callable[[], object]) -> tuple[str | None, str]:
    try:
        fn()
    except Exception as exc:  # reported to the parent, which checks the type
        return type(exc).__name__, str(exc)
    return None, ""


def _reraise(outcome: tuple[str | None, str]) -> None:
    kind, msg = outcome
    if kind == "ValueError":
        raise ValueError(msg)
    if kind is not None:
        raise RuntimeError(f"{kind} instead of ValueError: {msg}")


def _valid(s: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, H, generator=g).to(torch.bfloat16)
    w = torch.rand(s, K, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).to(torch.int32)
    hist = torch.bincount(topk.reshape(-1).long(), minlength=E).to(torch.int32)
    return x, w, topk, hist


def _still_correct(buf: Buffer, rank: int, topk_R: list[torch.Tensor], x_R: list[torch.Tensor],
                   w_R: list[torch.Tensor], total: int | None) -> str:
    """A valid dispatch + combine after the errors: every row is its source token (padding zero),
    and combining the dispatched rows gives K * x (K equal bf16 rows summed in fp32 are exact)."""
    R = len(topk_R)
    res = buf.dispatch(x_R[rank], w_R[rank], topk_R[rank], total_num_tokens=total)
    ref = reference_plan([t.tolist() for t in topk_R], E, E // R, PAD, total)
    for row, entry in enumerate(ref.row_entry[rank]):
        want = torch.zeros(H, dtype=torch.bfloat16) if entry is None else x_R[entry[0]][entry[1]]
        want_w = 0.0 if entry is None else float(w_R[entry[0]][entry[1], entry[2]])
        if not torch.equal(res.x_rows[row], want) or float(res.weights_rows[row]) != want_w:
            return f"row {row} (entry {entry}) holds {res.x_rows[row][:4].tolist()}, weight {res.weights_rows[row]}"
    y, _ = buf.combine(res.plan, res.x_rows.clone())
    want_y = (x_R[rank].float() * K).to(torch.bfloat16)
    if not torch.equal(y, want_y):
        return f"combine of the dispatched rows != K * x: {(y.float() - want_y.float()).abs().max().item()}"
    return "ok"


# ---------------------------------------------------------------------------------- R = 1
def _single_rank(rank: int, world: int) -> dict[str, tuple[str | None, str]]:
    out: dict[str, tuple[str | None, str]] = {}
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD, options=BufferOptions(timeout_s=30)))
    try:
        x, w, topk, hist = _valid()
        s = x.shape[0]
        big = _valid(S + 1)
        bad_hi, bad_lo, dup, bad_hist = topk.clone(), topk.clone(), topk.clone(), hist.clone()
        bad_hi[3, 1] = E
        bad_lo[1, 0] = -1
        dup[2, 1] = dup[2, 0]
        moved = int(topk[0, 0])
        bad_hist[moved] -= 1
        bad_hist[(moved + 1) % E] += 1
        d = buf.dispatch
        cases: dict[str, Callable[[], object]] = {
            "s > S": lambda: d(big[0], big[1], big[2], big[3]),
            "s < 1 (empty x)": lambda: d(x[:0].contiguous(), w[:0].contiguous(), topk[:0].contiguous()),
            "expert id >= E": lambda: d(x, w, bad_hi),
            "expert id < 0": lambda: d(x, w, bad_lo),
            "expert id >= E with a histogram": lambda: d(x, w, bad_hi, hist),
            "same expert twice in a token": lambda: d(x, w, dup),
            "histogram not matching topk": lambda: d(x, w, topk, bad_hist),
            "x dtype": lambda: d(x.float(), w, topk, hist),
            "weights dtype": lambda: d(x, w.to(torch.int64), topk, hist),
            "topk dtype": lambda: d(x, w, topk.float(), hist),
            "histogram dtype": lambda: d(x, w, topk, hist.float()),
            "x device": lambda: d(x.to("meta"), w, topk, hist),
            "topk device": lambda: d(x, w, topk.to("meta"), hist),
            "x shape": lambda: d(torch.zeros(s, H + 1, dtype=torch.bfloat16), w, topk, hist),
            "x 1-D": lambda: d(x[0].contiguous(), w, topk, hist),
            "topk shape": lambda: d(x, w, torch.zeros(s, K + 1, dtype=torch.int32), hist),
            "topk rows != x rows": lambda: d(x, w, topk[:-1].contiguous()),
            "topk rows != x rows, no weights": lambda: d(x, None, topk[:-1].contiguous()),
            "histogram shape": lambda: d(x, w, topk, torch.zeros(E + 1, dtype=torch.int32)),
            "weights shape": lambda: d(x, w[:, :1].contiguous(), topk, hist),
            "x non-contiguous": lambda: d(x.t().contiguous().t(), w, topk, hist),
            "topk non-contiguous": lambda: d(x, w, torch.cat([topk, topk], 1)[:, ::2], hist),
            "weights non-contiguous": lambda: d(x, w.t().contiguous().t(), topk, hist),
            "no routing and no plan": lambda: d(x, w),
            "total_num_tokens out of range": lambda: d(x, w, topk, hist, total_num_tokens=R_S_PLUS_1),
            "total_num_tokens not the sum": lambda: d(x, w, topk, hist, total_num_tokens=s + 1),
            "plan() with a bad expert id": lambda: buf.plan(bad_hi),
        }
        for name, fn in cases.items():
            out[name] = _outcome(fn)
        plan = buf.dispatch(x, w, topk, hist).plan
        out["plan reused with another s"] = _outcome(lambda: d(x[:-1].contiguous(), plan=plan))
        out["plan and routing together"] = _outcome(lambda: d(x, plan=plan, topk_sK=topk))
        y = torch.zeros(plan.nvs_s, H, dtype=torch.bfloat16)
        out["combine y dtype"] = _outcome(lambda: buf.combine(plan, y.float()))
        out["combine y shape"] = _outcome(lambda: buf.combine(plan, y[:-1].contiguous()))
        out["combine y non-contiguous"] = _outcome(lambda: buf.combine(plan, torch.cat([y, y], 1)[:, ::2]))
        out["combine row_scalars dtype"] = _outcome(
            lambda: buf.combine(plan, y, row_scalars=torch.zeros(plan.nvs_s, dtype=torch.float64)))
        out["heap granularity"] = _outcome(lambda: ExpertPools(buf, {"gate": (3, 5)}))
        out["no projections"] = _outcome(lambda: ExpertPools(buf, {}))
        out["projection shape"] = _outcome(lambda: ExpertPools(buf, {"gate": (H,)}))
        pools = ExpertPools(buf, glu_projections(H, 64))
        layer = pools.add_layer()
        out["unknown activation"] = _outcome(lambda: expert_glu(buf, pools, layer, x, w, topk, activation="relu"))
        few_slots = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD,
                                        num_slots=E - 1, options=BufferOptions(timeout_s=30)))
        try:
            other = few_slots.plan(topk)
            out["combine with another buffer's plan"] = _outcome(lambda: buf.combine(other, y))
            out["dispatch with another buffer's plan"] = _outcome(lambda: d(x, w, plan=other))
            out["prefetch with another buffer's plan"] = _outcome(lambda: buf.prefetch_weight(other, layer))
            made = make_plan(buf.layout, 0, topk, hist[None])
            out["combine with a make_plan plan"] = _outcome(lambda: buf.combine(made, y))
        finally:
            few_slots.destroy()
        out["still correct"] = ("ok", _still_correct(buf, rank, [topk], [x], [w], None))
    finally:
        buf.destroy()
    return out


R_S_PLUS_1 = S + 1  # one more than R * S at R = 1

SINGLE_RANK = {
    "s > S": r"s=9 tokens, but a buffer built with max_tokens S=8 takes 1 <= s <= 8",
    "s < 1 (empty x)": r"s=0 tokens, but a buffer built with max_tokens S=8",
    "expert id >= E": r"expert id 4, outside \[0, 4\)",
    "expert id < 0": r"expert id -1, outside \[0, 4\)",
    "expert id >= E with a histogram": r"expert id 4, outside \[0, 4\)",
    "same expert twice in a token": r"token 2 routes to the same expert twice",
    "histogram not matching topk": r"tokens_per_expert_E\[\d\]=\d+ but topk_sK routes \d+ tokens to expert \d",
    "x dtype": r"x_sH has dtype torch.float32, expected torch.bfloat16",
    "weights dtype": r"weights_sK has dtype torch.int64, expected torch.float32 or torch.bfloat16",
    "topk dtype": r"topk_sK has dtype torch.float32, expected torch.int32 or torch.int64",
    "histogram dtype": r"tokens_per_expert_E has dtype torch.float32",
    "x device": r"x_sH is on meta, expected the buffer's device cpu",
    "topk device": r"topk_sK is on meta, expected the buffer's device cpu",
    "x shape": r"x_sH has shape \(6, 33\), expected \(6, 32\)",
    "x 1-D": r"x_sH has shape \(32,\)",
    "topk shape": r"topk_sK has shape \(6, 3\), expected \(6, 2\)",
    "topk rows != x rows": r"topk_sK has shape \(5, 2\), expected \(6, 2\)",
    "topk rows != x rows, no weights": r"topk_sK has shape \(5, 2\), expected \(6, 2\)",
    "histogram shape": r"tokens_per_expert_E has shape \(5,\), expected \(4,\)",
    "weights shape": r"weights_sK has shape \(6, 1\), expected \(6, 2\)",
    "x non-contiguous": r"x_sH is not contiguous",
    "topk non-contiguous": r"topk_sK is not contiguous",
    "weights non-contiguous": r"weights_sK is not contiguous",
    "no routing and no plan": r"dispatch needs topk_sK",
    "total_num_tokens out of range": r"total_num_tokens=9 must lie in \[6, R\*S=8\]",
    "total_num_tokens not the sum": r"total_num_tokens=7 but the ranks hold \[6\] tokens",
    "plan() with a bad expert id": r"expert id 4, outside \[0, 4\)",
    "plan reused with another s": r"saved plan was made for s=6 tokens but x_sH has 5 rows",
    "plan and routing together": r"dispatch got both plan= and routing",
    "combine y dtype": r"y_rows has dtype torch.float32, expected torch.bfloat16",
    "combine y shape": r"y_rows has shape \(\d+, 32\), expected \(\d+, 32\)",
    "combine y non-contiguous": r"y_rows is not contiguous",
    "combine row_scalars dtype": r"row_scalars has dtype torch.float64, expected torch.float32",
    "heap granularity": r"rows of shape \(3, 5\) in torch.bfloat16 take \d+ bytes, not a multiple of the "
                        r"symmetric-heap granularity 4096 bytes",
    "no projections": r"ExpertPools needs at least one projection",
    "projection shape": r"projection 'gate' has shape \(32,\); expected \(in_features, out_features\)",
    "unknown activation": r"unknown expert activation 'relu'; moonep has \['situ_glu', 'swiglu'\]",
    "combine with another buffer's plan": r"combine got a plan this Buffer did not make \(Plan\)",
    "dispatch with another buffer's plan": r"dispatch got a plan this Buffer did not make",
    "prefetch with another buffer's plan": r"prefetch_weight got a plan this Buffer did not make",
    "combine with a make_plan plan": r"combine got a plan this Buffer did not make",
}


@pytest.fixture(scope="module")
def single_rank() -> dict[str, tuple[str | None, str]]:
    return run_ranks(_single_rank, 1, timeout_s=120)[0]


@pytest.mark.parametrize("case", list(SINGLE_RANK))
def test_single_rank_bad_input(single_rank: dict, case: str) -> None:
    with pytest.raises(ValueError, match=SINGLE_RANK[case]):
        _reraise(single_rank[case])


def test_buffer_still_correct_after_rejected_calls(single_rank: dict) -> None:
    assert single_rank["still correct"] == ("ok", "ok")


# ---------------------------------------------------------------------------------- R = 2
def _two_ranks(rank: int, world: int) -> dict[str, tuple[str | None, str]]:
    out: dict[str, tuple[str | None, str]] = {}
    out["E % R != 0"] = _outcome(lambda: Buffer(BufferConfig(max_tokens=S, hidden=H, topk=1, num_experts=3)))
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD, options=BufferOptions(timeout_s=30)))
    try:
        s_R = [4, 3]
        data = [_valid(s_R[r], seed=10 + r) for r in range(world)]
        x, w, topk, hist = data[rank]
        out["s differs across ranks"] = _outcome(lambda: buf.dispatch(x, w, topk, hist))
        out["total_num_tokens not the sum"] = _outcome(lambda: buf.dispatch(x, w, topk, hist, total_num_tokens=8))
        plan = buf.dispatch(x, w, topk, hist, total_num_tokens=7).plan
        out["plan reused with another s"] = _outcome(lambda: buf.dispatch(x[:-1].contiguous(), plan=plan))
        out["still correct"] = ("ok", _still_correct(buf, rank, [d[2] for d in data], [d[0] for d in data],
                                                      [d[1] for d in data], 7))
    finally:
        buf.destroy()
    few_slots = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD, num_slots=E // 2 - 1,
                                    options=BufferOptions(timeout_s=30)))
    try:  # training computes every remote expert from a slot: B < E // R would drop tokens' weights
        out["pools with num_slots < E // R"] = _outcome(lambda: ExpertPools(few_slots, glu_projections(H, 64)))
    finally:
        few_slots.destroy()
    return out


TWO_RANKS = {
    "E % R != 0": r"num_experts=3 is not divisible by the EP group size R=2",
    "s differs across ranks": r"s differs across ranks: \[4, 3\]; pass total_num_tokens=7",
    "total_num_tokens not the sum": r"total_num_tokens=8 but the ranks hold \[4, 3\] tokens \(sum 7\)",
    "plan reused with another s": r"saved plan was made for s=[43] tokens but x_sH has [32] rows",
    "pools with num_slots < E // R": r"ExpertPools needs one prefetch slot per remote expert a rank may compute: "
                                     r"the buffer has num_slots=1 < E // R = 2",
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, tuple[str | None, str]]]:
    return run_ranks(_two_ranks, 2, timeout_s=120)


@pytest.mark.parametrize("case", list(TWO_RANKS))
@pytest.mark.parametrize("rank", [0, 1])
def test_two_rank_bad_input_raises_on_every_rank(two_ranks: list[dict], rank: int, case: str) -> None:
    with pytest.raises(ValueError, match=TWO_RANKS[case]):
        _reraise(two_ranks[rank][case])


@pytest.mark.parametrize("rank", [0, 1])
def test_two_rank_buffer_still_correct_after_rejected_calls(two_ranks: list[dict], rank: int) -> None:
    assert two_ranks[rank]["still correct"] == ("ok", "ok")


# ---------------------------------------------------------------------------------- no process group
def test_layout_rejects_experts_not_divisible_by_ranks() -> None:
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=10)
    with pytest.raises(ValueError, match=r"num_experts=10 is not divisible by the EP group size R=4; use a multiple"):
        Layout(cfg, 4, 4096)


def _make_plan_case(case: str) -> None:
    """make_plan at R = 2 (rank 0, s = 6) with one input broken as `case` says."""
    layout = Layout(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=PAD), 2)
    _, _, topk, hist = _valid()
    counts = torch.stack([hist, _valid(seed=1)[3]])
    rank, total = 0, None
    if case == "row sum not s*K":
        counts[1, 0] += 1
    elif case == "s differs across ranks":
        counts[1, 0] += K
    elif case == "negative count":
        counts[1, 0] = -1
    elif case == "own row not the histogram of topk":
        counts[0, int(topk[0, 0])] -= 1
        counts[0, (int(topk[0, 0]) + 1) % E] += 1
    elif case == "rank out of range":
        rank = 2
    elif case == "expert id >= E":
        topk[0, 0] = E
    elif case == "counts shape":
        counts = counts[:, :-1].contiguous()
    elif case == "total_num_tokens not the sum":
        total = 13
    make_plan(layout, rank, topk, counts, total_num_tokens=total)


MAKE_PLAN = {
    "row sum not s*K": r"rank 1's histogram sums to 13, not s\*K for a whole number of tokens",
    "s differs across ranks": r"s differs across ranks: \[6, 7\]",
    "negative count": r"counts_RE\[1, 0\]=-1 is negative",
    "own row not the histogram of topk": r"tokens_per_expert_E\[\d\]=\d+ but topk_sK routes \d+ tokens",
    "rank out of range": r"rank=2 is outside \[0, 2\)",
    "expert id >= E": r"expert id 4, outside \[0, 4\)",
    "counts shape": r"counts_RE has shape \(2, 3\), expected \(2, 4\)",
    "total_num_tokens not the sum": r"total_num_tokens=13 but the ranks hold \[6, 6\] tokens",
}


@pytest.mark.parametrize("case", list(MAKE_PLAN))
def test_make_plan_validates_like_buffer_plan(case: str) -> None:
    with pytest.raises(ValueError, match=MAKE_PLAN[case]):
        _make_plan_case(case)


def test_make_plan_accepts_the_valid_case() -> None:
    _make_plan_case("valid")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_tokens": 0}, r"BufferConfig.max_tokens must be a positive int, got 0"),
    ({"hidden": -1}, r"BufferConfig.hidden must be a positive int, got -1"),
    ({"topk": 5}, r"BufferConfig.topk=5 exceeds num_experts=4"),
    ({"num_slots": 0}, r"BufferConfig.num_slots must be None \(derived: E // R, 0 on one rank\) or an int >= 1, got 0"),
    ({"token_padding": 0}, r"BufferConfig.token_padding must be a positive int, got 0"),
    ({"options": {"kernels": "torch"}}, r"BufferConfig.options must be a moonep.BufferOptions, got dict"),
])
def test_buffer_config_rejects_bad_sizes(kwargs: dict, match: str) -> None:
    base = {"max_tokens": S, "hidden": H, "topk": K, "num_experts": E}
    with pytest.raises(ValueError, match=match):
        BufferConfig(**{**base, **kwargs})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"timeout_s": 0.0}, r"BufferOptions.timeout_s must be a finite number of seconds > 0, got 0.0"),
    ({"timeout_s": float("nan")}, r"BufferOptions.timeout_s must be a finite number of seconds > 0, got nan"),
    ({"timeout_s": float("inf")}, r"BufferOptions.timeout_s must be a finite number of seconds > 0, got inf"),
    ({"kernels": "cuda"}, r"BufferOptions.kernels must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
    ({"check_values": "yes"}, r"BufferOptions.check_values must be None \(on for CPU buffers\), True or False"),
    ({"num_sms": 0}, r"BufferOptions.num_sms must be None \(every SM\) or an int >= 1, got 0"),
    ({"scatter_tile": 1000}, r"BufferOptions.scatter_tile must be a power of two >= 256, got 1000"),
    ({"fused_expert_gemm": 1}, r"BufferOptions.fused_expert_gemm must be True or False, got 1"),
    ({"expert_gemm": "cutlass"}, r"BufferOptions.expert_gemm must be one of \('torch', 'quack', 'quack_wgrad'\), got 'cutlass'"),
    ({"fused_expert_gemm": True, "expert_gemm": "quack"},
     r"BufferOptions.fused_expert_gemm \(moonep's Triton GEMMs\) and expert_gemm='quack' name two GEMM routes"),
])
def test_buffer_options_reject_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BufferOptions(**kwargs)


def _fused_on_torch_path(rank: int, world: int) -> str:
    try:
        Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E,
                            options=BufferOptions(fused_expert_gemm=True)))
    except ValueError as e:
        return str(e)
    return "no error"


def test_fused_expert_gemm_needs_the_triton_path() -> None:
    msg = run_ranks(_fused_on_torch_path, 1)[0]
    assert re.search(r"fused_expert_gemm needs the triton data path \(CUDA\), this buffer's is 'torch' on cpu",
                     msg), msg


def _quack_on_torch_path(rank: int, world: int, choice: str = "quack") -> str:
    try:
        Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, options=BufferOptions(expert_gemm=choice)))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("choice", ["quack", "quack_wgrad"])
def test_quack_expert_gemm_needs_the_triton_path(choice: str) -> None:
    msg = run_ranks(_quack_on_torch_path, 1, choice)[0]
    assert re.search(rf"expert_gemm='{choice}' needs the triton data path \(CUDA\), this buffer's is 'torch' on cpu; "
                     r"set expert_gemm='torch'", msg), msg


@pytest.mark.parametrize(("shape", "dtype"), [((3, 5), torch.bfloat16), ((3000, 7), torch.bfloat16),
                                              ((48, 10), torch.float32), ((6, 100), torch.bfloat16)])
def test_granularity_error_suggests_a_size_that_works(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """The message names the sizes and suggests an H' multiple; that suggestion must be accepted."""
    layout = Layout(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E), 2, 4096)
    with pytest.raises(ValueError, match=rf"expert rows of shape \({shape[0]}, {shape[1]}\)") as info:
        layout.expert_block_bytes(shape, dtype, 1)
    multiple = int(re.search(r"scale H' to a multiple of (\d+)", str(info.value)).group(1))
    layout.expert_block_bytes((shape[0], multiple), dtype, 1)  # must not raise


def test_quack_tile_names_are_checked_before_quack_is_imported() -> None:
    from moonep.kernels import quack_gemm

    with pytest.raises(ValueError, match=r"quack tile name 'pp128': expected \(pp\|co\)<M>x<N>\[-c<cluster M><cluster N>\]"):
        quack_gemm.gemm_config("pp128")
