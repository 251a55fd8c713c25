"""The data path at R = 2, 4, 8 ranks (one spawn per R, many checks inside), bitwise against
references computed from the global routing:

- the plan is identical on every rank (all_gather of the shared fields) and equals the
  independent reference of docs/moonep.md §5 (tests/moonep/helpers/planner_reference.py);
- dispatch: every valid row is x of its (source rank, token), every padding row exactly zero;
  the route weight per row likewise; the same with a saved plan and other data;
- combine: the fp32 sum of each token's K rows in ascending k; the per-(t, k) scalar gather;
  the zero-copy path (rows written into combine_input) gives the same bits;
- ExpertPools: prefetched slots are the owners' expert rows; ensure() re-prefetches after another
  layer used the slots and only then; reduce_grad adds the slot grads into the owners' rows in
  ascending source rank, is deterministic across two runs and leaves the consumed slots zero;
- static shapes: for a fixed s every tensor dispatch returns has the same shape at maxvio 0 and
  maxvio 20 (E = 384, K = 8);
- per-rank s with total_num_tokens.

Each rank collects failures as strings instead of raising, so that all ranks keep making the same
collective calls and the parent reports every failing check by name.

Legend: R ranks, E experts, epn = E / R, B = epn slots, K top-k, S capacity, s tokens, H hidden.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions, ExpertPools
from moonep.routing import generate_routing
from tests.dist_utils import run_ranks
from tests.moonep.helpers.planner_reference import RefPlan, reference_plan

H, F = 32, 64  # one expert projection of (32, 64) bf16 is 4096 bytes: one page of the CPU heap
PROJ = {"gate": (H, F), "down": (F, H)}
PROJ_IDX = {p: i for i, p in enumerate(PROJ)}  # distinct random streams per projection
SIZES = {2: dict(E=8, K=4, S=24, pad=4), 4: dict(E=16, K=4, S=20, pad=4), 8: dict(E=16, K=3, S=10, pad=2)}
SHAPE_E, SHAPE_K, SHAPE_S, SHAPE_MAXVIO = 384, 8, 48, 20.0  # R*S*K % E == 0: round robin is maxvio 0

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int32: torch.int32,
             torch.int64: torch.int64, torch.bool: torch.uint8}


def bitwise_mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when got and want are the same bits, else the first differing index and values."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {tuple(got.shape)} {got.dtype} vs reference {tuple(want.shape)} {want.dtype}"
    g = got.contiguous().view(_INT_VIEW[got.dtype])
    w = want.contiguous().view(_INT_VIEW[want.dtype])
    diff = g != w
    if not bool(diff.any()):
        return None
    idx = tuple(torch.nonzero(diff)[0].tolist())
    row = idx[:1]
    return (f"{name}: {int(diff.sum())} elements differ, first at {idx}: got {got[idx].item()!r}, "
            f"reference {want[idx].item()!r} (row {row[0]}: got {got[row].flatten()[:4].tolist()}..., "
            f"reference {want[row].flatten()[:4].tolist()}...)")


class Checks:
    """Failure messages by check name; every check name seen is reported (empty list = passed)."""

    def __init__(self) -> None:
        self.failures: dict[str, list[str]] = {}

    def bitwise(self, check: str, ctx: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        msg = bitwise_mismatch(name, got, want)
        self.failures.setdefault(check, [])
        if msg is not None:
            self.failures[check].append(f"{ctx}: {msg}")

    def true(self, check: str, ctx: str, cond: bool, msg: str) -> None:
        self.failures.setdefault(check, [])
        if not cond:
            self.failures[check].append(f"{ctx}: {msg}")


# ---------------------------------------------------------------------------------- problems
def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1000003 + k
    return torch.Generator().manual_seed(seed % (2**62))


def _cases(R: int, E: int, K: int, S: int) -> list[tuple[str, list[torch.Tensor], int | None]]:
    """(name, topk per rank, total_num_tokens) computed identically on every rank."""
    cases = []
    skew = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K,
                            target_maxvio=min(3.0, E / K - 1.2), seed=11)
    cases.append((f"skewed maxvio {skew.realised_maxvio:.2f}", list(skew.topk_RsK), None))
    rr = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=0.0)
    cases.append(("round robin", list(rr.topk_RsK), None))
    hot = torch.arange(E - K, E, dtype=torch.int32).repeat(S // 2, 1)
    cases.append(("all tokens to the last K experts", [hot.clone() for _ in range(R)], None))
    g = _gen(R, 5)
    one = [torch.randperm(E, generator=g)[:K].to(torch.int32).view(1, K) for _ in range(R)]
    cases.append(("s=1", one, None))
    s_R = [1 + (r * 7) % S for r in range(R)]
    s_R[-1] = S
    pr = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=min(2.0, E / K - 1.2),
                          seed=12)
    cases.append((f"per-rank s={s_R}", [pr.topk_RsK[r, :s_R[r]].contiguous() for r in range(R)], sum(s_R)))
    return cases


def _rows(n: int, key: tuple[int, ...], width: int = H) -> torch.Tensor:
    return torch.randn(n, width, generator=_gen(*key)).to(torch.bfloat16)


def _wide_rows(n: int, key: tuple[int, ...]) -> torch.Tensor:
    """bf16 rows whose magnitudes span 2**-24 .. 2**24, so an fp32 sum depends on its order."""
    g = _gen(*key)
    scale = torch.exp2(torch.randint(-24, 25, (n, H), generator=g).float())
    return (torch.randn(n, H, generator=g) * scale).to(torch.bfloat16)


def _expected_rows(ref: RefPlan, d: int, x_R: list[torch.Tensor], w_R: list[torch.Tensor] | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(ref.nvs_s, x_R[0].shape[1], dtype=torch.bfloat16)
    w = torch.zeros(ref.nvs_s, dtype=torch.float32)
    for row, entry in enumerate(ref.row_entry[d]):
        if entry is not None:
            src, t, k = entry
            x[row] = x_R[src][t]
            if w_R is not None:
                w[row] = w_R[src][t, k]
    return x, w


def _expected_combine(ref: RefPlan, r: int, y_R: list[torch.Tensor], sc_R: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    s, K = len(ref.dst_rank[r]), len(ref.dst_rank[r][0])
    y = torch.empty(s, y_R[0].shape[1], dtype=torch.bfloat16)
    sc = torch.empty(s, K, dtype=torch.float32)
    for t in range(s):
        acc = None
        for k in range(K):  # fp32, ascending k
            d, row = ref.dst_rank[r][t][k], ref.dst_row[r][t][k]
            v = y_R[d][row].float()
            acc = v.clone() if acc is None else acc + v
            sc[t, k] = sc_R[d][row]
        y[t] = acc.to(torch.bfloat16)
    return y, sc


# ---------------------------------------------------------------------------------- rank side
def _check_plan(c: Checks, ctx: str, plan, ref: RefPlan, rank: int) -> None:
    want = {"cap_R": ref.cap, "quota_RR": ref.quota, "alloc_ER": ref.alloc, "slot_expert_RB": ref.slot_expert,
            "group_rows_RG": ref.group_rows, "offs_RG": ref.offs, "dst_rank_sK": ref.dst_rank[rank],
            "dst_row_sK": ref.dst_row[rank], "copy_row_sK": ref.copy_row[rank], "sent_sK": ref.sent[rank]}
    for name, value in want.items():
        got = getattr(plan, name)
        c.bitwise("plan equals the independent reference", ctx, name, got, torch.tensor(value, dtype=got.dtype))
    c.true("plan equals the independent reference", ctx, plan.nvs_s == ref.nvs_s, f"nvs_s {plan.nvs_s} != {ref.nvs_s}")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, plan.shared())
    for r, shared in enumerate(gathered):
        for name, t in plan.shared().items():
            c.bitwise("plan identical on every rank", ctx, f"{name} of rank {r} vs rank {rank}", shared[name], t)


def _fill_weights(layers, rank: int, epn: int) -> dict:
    """Known expert weights W[layer][proj] [E, in, out] (every rank computes all of them)."""
    E = epn * dist.get_world_size()
    W = {li: {p: torch.randn(E, *shape, generator=_gen(7, li, PROJ_IDX[p])).to(torch.bfloat16) for p, shape in PROJ.items()}
         for li in range(len(layers))}
    for li, layer in enumerate(layers):
        for p in PROJ:
            layer.w_local[p].copy_(W[li][p][rank * epn:(rank + 1) * epn])
    return W


def _check_slots(c: Checks, check: str, ctx: str, plan, layer, W: dict, E: int, epn: int) -> None:
    for j, e in enumerate(plan.slot_expert_RB[plan.rank].tolist()):
        if e < 0:
            continue
        for p in PROJ:
            c.bitwise(check, ctx, f"{p} slot {j} (expert {e}) in w_compact", layer.w_compact[p][epn + j], W[p][e])
            c.bitwise(check, ctx, f"{p} slot {j} (expert {e}) in w_full", layer.w_full[p][E + j], W[p][e])


def _reduce_grad_once(pools, layer, plan, rank: int, epn: int, key: int) -> tuple[dict, dict, dict]:
    """Fill this rank's grad rows and reduce pool with known values, reduce; -> (result, reference,
    this rank's reduce pool afterwards)."""
    R, B = plan.num_ranks, plan.num_slots
    init = {p: torch.randn(R, epn, *s, generator=_gen(key, 1, PROJ_IDX[p])) for p, s in PROJ.items()}
    slot = {p: torch.randn(R, B, *s, generator=_gen(key, 2, PROJ_IDX[p])) for p, s in PROJ.items()}
    for p in PROJ:
        layer.g_local[p].copy_(init[p][rank])
        layer.g_compact[p][epn:].copy_(slot[p][rank])  # unused slots hold junk that must be ignored
    pools.buffer.reduce_grad(plan, layer)
    want = {}
    slot_e = plan.slot_expert_RB.tolist()
    for p in PROJ:
        acc = init[p][rank].clone()
        for d in range(R):  # ascending source rank
            for j, e in enumerate(slot_e[d]):
                if e >= 0 and e // epn == rank:
                    acc[e - rank * epn] = acc[e - rank * epn] + slot[p][d, j]
        want[p] = acc
    got = {p: layer.g_local[p].clone() for p in PROJ}
    zero = {p: layer.g_compact[p][epn:].clone() for p in PROJ}
    return got, want, zero


def _data_path_rank(rank: int, R: int) -> dict:
    sz = SIZES[R]
    E, K, S, pad = sz["E"], sz["K"], sz["S"], sz["pad"]
    epn = E // R
    c = Checks()
    info: dict = {"slots_used": 0, "remote_rows": 0}
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=pad, options=BufferOptions(timeout_s=60)))
    try:
        pools = ExpertPools(buf, PROJ)
        layers = [pools.add_layer(), pools.add_layer()]
        W = _fill_weights(layers, rank, epn)
        buf.barrier("test:weights written")
        for p in PROJ:  # W_full rows [0, E) are every owner's rows, mapped
            c.bitwise("prefetched slots are the owners' rows", "setup", f"{p} w_full[:E]", layers[1].w_full[p][:E],
                      W[1][p])
        for ci, (name, topk_R, total) in enumerate(_cases(R, E, K, S)):
            ctx = f"R={R} rank {rank} case {name!r}"
            s_R = [t.shape[0] for t in topk_R]
            ref = reference_plan([t.tolist() for t in topk_R], E, epn, pad, total)
            x_R = [_rows(s_R[r], (ci, r, 1)) for r in range(R)]
            w_R = [torch.rand(s_R[r], K, generator=_gen(ci, r, 2)) for r in range(R)]
            hist = torch.bincount(topk_R[rank].reshape(-1).long(), minlength=E).to(torch.int32)
            res = buf.dispatch(x_R[rank], w_R[rank], topk_R[rank], hist, total_num_tokens=total)
            plan = res.plan
            info["slots_used"] += int((plan.slot_expert_RB >= 0).sum())
            if ci == 0:
                saved = (plan, ref, s_R)
            _check_plan(c, ctx, plan, ref, rank)
            want_x, want_w = _expected_rows(ref, rank, x_R, w_R)
            c.bitwise("dispatched rows equal a direct gather", ctx, "x_rows", res.x_rows, want_x)
            c.bitwise("dispatched rows equal a direct gather", ctx, "weights_rows", res.weights_rows, want_w)
            lo = rank * epn
            want_cu = torch.tensor(ref.offs[rank][lo:lo + epn] + ref.offs[rank][E:], dtype=torch.int32)
            c.bitwise("dispatched rows equal a direct gather", ctx, "cu_seqlens", res.cu_seqlens, want_cu)
            c.true("dispatched rows equal a direct gather", ctx,
                   sum(e is not None for e in ref.row_entry[rank]) == ref.cap[rank], "valid rows != cap")
            info["remote_rows"] += sum(1 for e in ref.row_entry[rank] if e is not None and e[0] != rank)

            # prefetch layer 0; ensure() after layer 1 used the slots brings layer 0 back, and only then
            buf.prefetch_weight(plan, layers[0])
            _check_slots(c, "prefetched slots are the owners' rows", f"{ctx} layer 0", plan, layers[0], W[0], E, epn)
            pools.prefetch(plan, layers[1])
            _check_slots(c, "prefetched slots are the owners' rows", f"{ctx} layer 1", plan, layers[1], W[1], E, epn)
            pools.ensure(plan, layers[0])
            _check_slots(c, "ensure re-prefetches only when needed", f"{ctx} ensure", plan, layers[0], W[0], E, epn)
            marker = {p: layers[0].w_compact[p][epn:].clone() for p in PROJ}
            for p in PROJ:
                layers[0].w_compact[p][epn:].fill_(3.0)
            pools.ensure(plan, layers[0])  # slots already hold this layer's copies: nothing to do
            for p in PROJ:
                c.true("ensure re-prefetches only when needed", ctx,
                       bool((layers[0].w_compact[p][epn:] == 3.0).all()), "ensure() copied although current")
                layers[0].w_compact[p][epn:].copy_(marker[p])
            buf.barrier("test:slots")  # no peer may still read these slots (they do not, but be explicit)

            # combine with known y rows and row scalars, copying and zero-copy
            nvs = plan.nvs_s
            y_R = [_wide_rows(nvs, (ci, d, 3)) for d in range(R)]
            sc_R = [torch.randn(nvs, generator=_gen(ci, d, 4)) for d in range(R)]
            want_y, want_sc = _expected_combine(ref, rank, y_R, sc_R)
            y, sc = buf.combine(plan, y_R[rank].clone(), row_scalars=sc_R[rank].clone())
            c.bitwise("combine is the fp32 sum in ascending k", ctx, "y_sH", y, want_y)
            c.bitwise("route-weight scalar gather", ctx, "scalars_sK", sc, want_sc)
            buf.combine_input(plan).copy_(y_R[rank])
            y0, none = buf.combine(plan, buf.combine_input(plan))
            c.bitwise("combine is the fp32 sum in ascending k", f"{ctx} zero-copy", "y_sH", y0, want_y)
            c.true("route-weight scalar gather", ctx, none is None, "scalars returned without row_scalars")

            # dispatch with the saved plan (as in backward): other data, same destinations
            x2_R = [_rows(s_R[r], (ci, r, 5)) for r in range(R)]
            res2 = buf.dispatch(x2_R[rank], plan=plan)
            want_x2, _ = _expected_rows(ref, rank, x2_R, None)
            c.bitwise("dispatch with a saved plan", ctx, "x_rows", res2.x_rows, want_x2)
            c.bitwise("dispatch with a saved plan", ctx, "cu_seqlens", res2.cu_seqlens, want_cu)

            # reduce_grad: owner rows = init + slot grads in ascending source rank; twice, same bits
            runs = [_reduce_grad_once(pools, layers[0], plan, rank, epn, 100 + ci) for _ in range(2)]
            for p in PROJ:
                c.bitwise("reduce_grad sums in a fixed order", ctx, f"g_local[{p}]", runs[0][0][p], runs[0][1][p])
                c.bitwise("reduce_grad is deterministic", ctx, f"g_local[{p}] run 2 vs 1", runs[1][0][p], runs[0][0][p])
                for run in runs:
                    c.bitwise("reduce_grad zeroes consumed slots", ctx, f"reduce pool {p}", run[2][p],
                              torch.zeros_like(run[2][p]))
                c.true("reduce_grad sums in a fixed order", ctx, bool((layers[1].g_local[p] == 0).all()),
                       "reduce_grad of layer 0 touched layer 1's grads")
        # backward reuses a plan saved many calls earlier: same destinations, fresh data
        plan, ref, s_R = saved
        ctx = f"R={R} rank {rank} saved plan of case 0 after the other cases"
        x3_R = [_rows(s_R[r], (90, r)) for r in range(R)]
        res3 = buf.dispatch(x3_R[rank], plan=plan)
        c.bitwise("dispatch with a saved plan", ctx, "x_rows", res3.x_rows, _expected_rows(ref, rank, x3_R, None)[0])
        y_R = [_wide_rows(plan.nvs_s, (91, d)) for d in range(R)]
        sc_R = [torch.randn(plan.nvs_s, generator=_gen(92, d)) for d in range(R)]
        want_y, want_sc = _expected_combine(ref, rank, y_R, sc_R)
        y, sc = buf.combine(plan, y_R[rank].clone(), row_scalars=sc_R[rank].clone())
        c.bitwise("combine is the fp32 sum in ascending k", ctx, "y_sH", y, want_y)
        c.bitwise("route-weight scalar gather", ctx, "scalars_sK", sc, want_sc)
        pools_info = {"slots_used": info["slots_used"], "remote_rows": info["remote_rows"]}
    finally:
        buf.destroy()
    shapes = _static_shapes_rank(rank, R, c)
    overflow = _few_slots_rank(rank, R, c)
    return {"failures": dict(c.failures), **pools_info, **shapes, "overflow_rows": overflow}


def _overflow_case(R: int, E: int, K: int, S: int) -> tuple[str, list[torch.Tensor], None]:
    """The first seeded log-normal routing in which some rank needs two remote experts."""
    epn = E // R
    for seed in range(500):
        g = _gen(70, seed)
        log_p = (1.0 + seed % 3) * torch.randn(E, generator=g)
        topk_R = [(log_p - torch.empty(S, E).exponential_(generator=g).log()).topk(K, dim=1).indices.to(torch.int32)
                  for _ in range(R)]
        ref = reference_plan([t.tolist() for t in topk_R], E, 1, 1)
        if any(sum(ref.alloc[e][d] > 0 and e // epn != d for e in range(E)) >= 2 for d in range(R)):
            return f"two remote experts (seed {seed})", topk_R, None
    raise AssertionError("no routing with two remote experts on a rank")


def _few_slots_rank(rank: int, R: int, c: Checks) -> int:
    """Inference with B = 1 < epn where possible: remote experts past the first keep their home
    W_full row; rows still land where the reference says, cu_seqlens_full covers them. Also the
    GPU hot-path settings: check_values=False and bf16 route weights."""
    sz = SIZES[R]
    E, K, S, pad = sz["E"], sz["K"], sz["S"], sz["pad"]
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=pad, num_slots=1, options=BufferOptions(timeout_s=60, check_values=False)))
    overflow = 0
    try:
        for name, topk_R, total in [*_cases(R, E, K, S), _overflow_case(R, E, K, S)]:
            ctx = f"R={R} rank {rank} B=1 case {name!r}"
            s_R = [t.shape[0] for t in topk_R]
            ref = reference_plan([t.tolist() for t in topk_R], E, 1, pad, total)
            x_R = [_rows(s_R[r], (60, r)) for r in range(R)]
            w_R = [torch.rand(s_R[r], K, generator=_gen(61, r)).to(torch.bfloat16) for r in range(R)]
            res = buf.dispatch(x_R[rank], w_R[rank], topk_R[rank], total_num_tokens=total)
            want_x, want_w = _expected_rows(ref, rank, x_R, w_R)
            c.bitwise("fewer slots than remote experts (inference)", ctx, "x_rows", res.x_rows, want_x)
            c.bitwise("fewer slots than remote experts (inference)", ctx, "weights_rows", res.weights_rows, want_w)
            c.bitwise("fewer slots than remote experts (inference)", ctx, "cu_seqlens_full",
                      res.plan.cu_seqlens_full, torch.tensor(ref.offs[rank], dtype=torch.int32))
            epn = E // R
            overflow += sum(ref.group_rows[rank][e] for e in range(E) if e // epn != rank)
    finally:
        buf.destroy()
    return overflow


def _static_shapes_rank(rank: int, R: int, c: Checks) -> dict:
    """Same s, maxvio 0 and maxvio 20: identical shapes of everything dispatch returns."""
    E, K, S = SHAPE_E, SHAPE_K, SHAPE_S
    buf = Buffer(BufferConfig(max_tokens=S, hidden=16, topk=K, num_experts=E, token_padding=8, options=BufferOptions(timeout_s=60)))
    shapes, realised, slots = [], [], []
    try:
        for ci, maxvio in enumerate((0.0, SHAPE_MAXVIO)):
            routing = generate_routing(num_ranks=R, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=maxvio,
                                       seed=3)
            realised.append(routing.realised_maxvio)
            topk_R = list(routing.topk_RsK)
            x_R = [_rows(S, (50 + ci, r), 16) for r in range(R)]
            w_R = [torch.rand(S, K, generator=_gen(50 + ci, r, 9)) for r in range(R)]
            res = buf.dispatch(x_R[rank], w_R[rank], *routing.for_rank(rank))
            ctx = f"R={R} rank {rank} maxvio {routing.realised_maxvio:.2f}"
            shape = {"x_rows": res.x_rows.shape, "weights_rows": res.weights_rows.shape,
                     "cu_seqlens": res.cu_seqlens.shape, "nvs_s": res.plan.nvs_s}
            shape.update({f"plan.{k}": getattr(res.plan, k).shape for k in vars(res.plan)
                          if isinstance(getattr(res.plan, k), torch.Tensor)})
            shapes.append(shape)
            slots.append(int((res.plan.slot_expert_RB >= 0).sum()))
            ref = reference_plan([t.tolist() for t in topk_R], E, E // R, 8)
            want_x, want_w = _expected_rows(ref, rank, x_R, w_R)
            c.bitwise("static shapes at maxvio 0 and 20", ctx, "x_rows", res.x_rows, want_x)
            c.bitwise("static shapes at maxvio 0 and 20", ctx, "weights_rows", res.weights_rows, want_w)
        c.true("static shapes at maxvio 0 and 20", f"R={R} rank {rank}", shapes[0] == shapes[1],
               f"shapes differ: {shapes[0]} vs {shapes[1]}")
    finally:
        buf.destroy()
    return {"shape_maxvio": realised, "shape_slots": slots}


# ---------------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module", params=[2, 4, pytest.param(8, marks=pytest.mark.slow)],  # 8 ranks: slow
                ids=lambda R: f"R{R}")
def data_path(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    R = request.param
    return R, run_ranks(_data_path_rank, R, timeout_s=400)


CHECKS = [
    "plan equals the independent reference",
    "plan identical on every rank",
    "dispatched rows equal a direct gather",
    "dispatch with a saved plan",
    "combine is the fp32 sum in ascending k",
    "route-weight scalar gather",
    "prefetched slots are the owners' rows",
    "ensure re-prefetches only when needed",
    "reduce_grad sums in a fixed order",
    "reduce_grad is deterministic",
    "reduce_grad zeroes consumed slots",
    "static shapes at maxvio 0 and 20",
    "fewer slots than remote experts (inference)",
]


@pytest.mark.parametrize("check", CHECKS)
def test_data_path(data_path: tuple[int, list[dict]], check: str) -> None:
    R, out = data_path
    for rank, o in enumerate(out):
        assert check in o["failures"], f"rank {rank} never ran the check {check!r}"
        fails = o["failures"][check]
        assert not fails, f"R={R} rank {rank}: {len(fails)} failures of {check!r}; first:\n" + "\n".join(fails[:3])


def test_data_path_exercises_slots_and_maxvio_20(data_path: tuple[int, list[dict]]) -> None:
    """The routings must be skewed enough that the checks above cover redundant experts."""
    _, out = data_path
    assert out[0]["slots_used"] > 0, "no case used a prefetch slot"
    assert all(o["remote_rows"] > 0 for o in out), [o["remote_rows"] for o in out]
    lo, hi = out[0]["shape_maxvio"]
    assert lo == 0.0 and abs(hi - SHAPE_MAXVIO) <= 1.0, f"realised maxvio {lo}, {hi}"
    assert any(o["overflow_rows"] > 0 for o in out), "no rank read a remote expert from its home row at B=1"
    assert out[0]["shape_slots"][1] > 0, f"maxvio 20 used no slot: {out[0]['shape_slots']}"


def _plan_twice_rank(rank: int, world: int) -> list[str]:
    """Two plan() calls in a row while rank 1 is slow to read its gathered histograms after the
    first exchange: each plan must see exactly the histograms of its own call."""
    import time

    E, K, S = 8, 2, 16
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4))
    failures = []
    try:
        routings = [generate_routing(num_ranks=world, tokens_per_rank=S, num_experts=E, topk=K, target_maxvio=v,
                                     seed=seed) for v, seed in ((0.0, 1), (2.0, 2))]
        if rank == 1:
            barrier, delayed = buf.heap.barrier, []

            def slow_after_first_exchange(call: str) -> None:
                barrier(call)
                if call == "dispatch:histograms" and not delayed:
                    delayed.append(call)
                    time.sleep(1.0)  # the peer meanwhile starts its second plan()

            buf.heap.barrier = slow_after_first_exchange
        plans = [buf.plan(r.topk_RsK[rank]) for r in routings]
        for i, (plan, r) in enumerate(zip(plans, routings, strict=True)):
            if not torch.equal(plan.counts_RE, r.tokens_per_expert_RE.to(torch.int32)):
                failures.append(f"rank {rank} plan {i}: gathered histograms {plan.counts_RE.tolist()} "
                                f"!= {r.tokens_per_expert_RE.tolist()}")
    finally:
        buf.destroy()
    return failures


def test_back_to_back_plans_read_their_own_histograms() -> None:
    failures = [f for fs in run_ranks(_plan_twice_rank, 2) for f in fs]
    assert not failures, "\n".join(failures)
