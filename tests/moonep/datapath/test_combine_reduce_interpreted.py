"""combine_reduce "destination" (BufferOptions): a token's rows summed per destination rank before
they travel, on the PyTorch path and the Triton kernels in Triton's interpreter.

Checks, on 1 and 2 gloo ranks over the CPU heap:
- the PyTorch path == an independent per-token loop of the documented order (bitwise): on each
  destination the token's entries there summed in fp32 in ascending k (the first taken as is), one
  rounding; on the source the partials summed in fp32 in ascending k of their first entry, one
  rounding; row scalars per entry; entries mode (absent entries) included;
- the Triton kernels == the PyTorch path (bitwise) for both settings: plain rows, row scalars,
  route weights folded in (row_weights), two row tensors added (add_rows), and the refresh branch
  (a plan that is not the last dispatch's);
- the destination push's two kernels alone, over several segments and blocks: the chain lists ==
  a PyTorch walk of the chains (K = 1, 4, 16; padding rows with noise in their chain), the reduce
  push == the chains summed in PyTorch (bitwise, landing rows and scalars, untouched rows kept);
- "destination" against "source" (fed each row's value rounded once, as the old path with a
  separate route-weight scale and dgrad add does) within the bound `_order_bound` derives; at R = 1
  and plain rows bit for bit.

The interpreter casts fp32 -> bf16 by truncation where the GPU rounds to nearest even; this module
makes it round (`_cast_rtne`), so the bits compare as on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moonep import BufferConfig, BufferOptions
from tests.dist_utils import run_ranks

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel; inherited by spawned ranks
_interpreter = pytest.importorskip("triton.runtime.interpreter")
import tests.moonep.helpers.triton_interpreted  # noqa: E402,F401  (its interpreter shims, e.g. range(0, n))

_cast_impl = _interpreter.InterpreterBuilder.cast_impl


def _cast_rtne(self, src, dst_type):
    """triton 3.5's interpreter truncates fp32 -> bf16; round to nearest even as the GPU (and torch)
    does. Test-only shim: the GPU never runs the interpreter."""
    tl = _interpreter.tl
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return _interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _cast_impl(self, src, dst_type)


_interpreter.InterpreterBuilder.cast_impl = _cast_rtne

S, H, K = 24, 80, 4


def _rows(n: int, key: int, width: int = H) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(key)).to(torch.bfloat16)


def _naive(rank: int, world: int, plans_R: list, vals_R: list[torch.Tensor], scal_R: list[torch.Tensor] | None,
           trash_row: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The documented order, one token at a time: vals_R[d] are rank d's fp32 row values (every
    rank's plan has the same nvs_s), plans_R[rank] this rank's plan."""
    plan = plans_R[rank]
    s = plan.num_tokens
    y = torch.zeros(s, H, dtype=torch.bfloat16)
    scal = torch.zeros(s, K) if scal_R is not None else None
    for t in range(s):
        partials: dict[int, tuple[int, torch.Tensor]] = {}  # dst rank -> (first k, fp32 sum)
        for k in range(K):
            d, row = int(plan.dst_rank_sK[t, k]), int(plan.dst_row_sK[t, k])
            if row == trash_row:  # absent entry (entries mode)
                continue
            v = vals_R[d][row]
            if scal is not None:
                scal[t, k] = scal_R[d][row]
            if d in partials:
                partials[d] = (partials[d][0], partials[d][1] + v)
            else:
                partials[d] = (k, v.clone())
        total = None
        for _, p in sorted(partials.values(), key=lambda kp: kp[0]):
            p = p.to(torch.bfloat16).float()
            total = p if total is None else total + p
        if total is not None:
            y[t] = total.to(torch.bfloat16)
    return y, scal


def _order_bound(plan, vals_R: list[torch.Tensor], src_vals_R: list[torch.Tensor]) -> torch.Tensor:
    """Bound on |y_destination - y_source| per element (float64), where "destination" sums the fp32
    row values vals_R and "source" the values src_vals_R (the same, or the old path's per-row bf16
    roundings of them: o * w rounded before combine, the two dgrad halves added in bf16).

    For one token let v_k be the K fp32 values "destination" sums, P_j their fp32 sums on rank j (its
    partials), X_d = sum_k v_k and X_s = sum_k v'_k exactly (v' the values "source" sums). "source"
    returns round(S_s), "destination" round(S_d), S_s an fp32 sum of the v'_k, S_d one of round(P_j).
    Rounding to bf16 moves x by at most u|x|, u = 2^-8; an fp32 sum of n terms is within
    (n - 1) 2^-24 sum|terms| of the exact sum (a partial's own fp32 sum included: n <= K). So
      |S_d - X_d| <= D = sum_j u|P_j| + K 2^-24 (sum_k|v_k| + sum_j|P_j|) (1 + u),
      |S_s - X_s| <= C = K 2^-24 sum_k|v'_k|,
      |y_d - y_s| <= D + |X_d - X_s| + C + u (|X_d| + D + |X_s| + C),
    with |X_d - X_s| computed exactly in float64 (0 when the values are the same).
    """
    u, e = 2.0**-8, 2.0**-24
    s = plan.num_tokens
    bound = torch.zeros(s, H, dtype=torch.float64)
    for t in range(s):
        parts: dict[int, torch.Tensor] = {}
        abs_v, abs_src = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
        x_d, x_s = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
        for k in range(K):
            d, row = int(plan.dst_rank_sK[t, k]), int(plan.dst_row_sK[t, k])
            v, v_src = vals_R[d][row].double(), src_vals_R[d][row].double()
            parts[d] = parts.get(d, torch.zeros(H, dtype=torch.float64)) + v
            abs_v += v.abs()
            abs_src += v_src.abs()
            x_d += v
            x_s += v_src
        abs_p = sum(p.abs() for p in parts.values())
        dest_err = u * abs_p + K * e * (abs_v + abs_p) * (1 + u)
        src_err = K * e * abs_src
        bound[t] = dest_err + (x_d - x_s).abs() + src_err + u * (x_d.abs() + dest_err + x_s.abs() + src_err)
    return bound


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when bitwise equal, else the first differing element."""
    if got.shape == want.shape and torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got,
                                               want.view(torch.uint8) if want.dtype != torch.bool else want):
        return None
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.float() != want.float()) | (torch.signbit(got.float()) != torch.signbit(want.float()))
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return f"{name}: first mismatch at {idx}: {got[idx].item()!r} != {want[idx].item()!r}"


def _combine_rank(rank: int, world: int) -> list[str]:
    import moonep.buffer as buffer_module
    from moonep import Buffer
    from moonep.datapath.reference import row_values
    from moonep.routing import generate_routing

    E = 16
    errors: list[str | None] = []

    def cfg(reduce: str) -> BufferConfig:
        return BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4,
                            options=BufferOptions(num_sms=3, combine_reduce=reduce))

    bufs = {("torch", "source"): Buffer(cfg("source")), ("torch", "destination"): Buffer(cfg("destination"))}
    # the triton path is CUDA-only by design; force it onto the CPU heap for the interpreter
    resolve = buffer_module.resolve_kernels
    buffer_module.resolve_kernels = lambda kernels, device: "triton"
    try:
        bufs["triton", "source"] = Buffer(cfg("source"))
        bufs["triton", "destination"] = Buffer(cfg("destination"))
    finally:
        buffer_module.resolve_kernels = resolve
    try:
        # the expert op asks the path, not the options, where combine sums (moonep.moe._fused_combine)
        errors += [f"{kind} path for {reduce!r}: {buf.path.name} path, combine_reduce {buf.path.combine_reduce!r}"
                   for (kind, reduce), buf in bufs.items() if (buf.path.name, buf.path.combine_reduce) != (kind, reduce)]
        for case, (maxvio, s) in enumerate(((0.0, S), (1.0, 19), (2.5, S))):
            routing = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K,
                                       target_maxvio=maxvio, seed=5 + case)
            other = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K,
                                     target_maxvio=1.5, seed=50 + case)
            topk, hist = routing.for_rank(rank)
            g = torch.Generator().manual_seed(100 * rank + case)
            x = torch.randn(s, H, generator=g).to(torch.bfloat16)
            w = torch.rand(s, K, generator=g)
            outs = {}
            for key, buf in bufs.items():
                res = buf.dispatch(x, w, topk, hist)
                plan, n = res.plan, res.plan.nvs_s
                seeds = [1000 * d + 10 * case for d in range(world)]  # every rank can rebuild every rank's inputs
                y_R = [_rows(n, sd) for sd in seeds]
                add_R = [_rows(n, sd + 1) for sd in seeds]
                wt_R = [torch.rand(n, generator=torch.Generator().manual_seed(sd + 2)) for sd in seeds]
                sc_R = [torch.randn(n, generator=torch.Generator().manual_seed(sd + 3)) for sd in seeds]
                out = {"rows": res.x_rows.clone()}
                out["y"], out["scal"] = (t.clone() for t in buf.combine(plan, y_R[rank], row_scalars=sc_R[rank]))
                out["y_w"] = buf.combine(plan, y_R[rank], row_weights=wt_R[rank])[0].clone()
                out["y_add"], out["scal_add"] = (t.clone() for t in buf.combine(
                    plan, y_R[rank], row_scalars=sc_R[rank], add_rows=add_R[rank], row_weights=wt_R[rank]))
                # a plan that is not the last dispatch's: combine rewrites the rows' sources first
                buf.dispatch(x, w, *other.for_rank(rank))
                out["y_stale"] = buf.combine(plan, y_R[rank], row_scalars=sc_R[rank])[0].clone()
                outs[key] = out
                if key == ("torch", "destination"):
                    trash = buf.layout.trash_row
                    plans_R = [plan if d == rank else None for d in range(world)]
                    for name, vals_R, with_scal in (
                            ("y", [v.float() for v in y_R], True),
                            ("y_w", [row_values(v, wt, None) for v, wt in zip(y_R, wt_R, strict=True)], False),
                            ("y_add", [row_values(v, wt, a) for v, wt, a in zip(y_R, wt_R, add_R, strict=True)],
                             True)):
                        want_y, want_sc = _naive(rank, world, plans_R, vals_R, sc_R if with_scal else None, trash)
                        errors.append(_mismatch(f"case {case} naive {name}", out[name], want_y))
                        if with_scal:
                            errors.append(_mismatch(f"case {case} naive scalars {name}", out["scal"], want_sc))
                    errors.append(_mismatch(f"case {case} naive y_stale", out["y_stale"], out["y"]))
                    # against "source" fed as the old path feeds it: each row's value rounded once
                    for name, vals_R in (
                            ("y", [v.float() for v in y_R]),
                            ("y_w", [row_values(v, wt, None) for v, wt in zip(y_R, wt_R, strict=True)]),
                            ("y_add", [row_values(v, wt, a) for v, wt, a in zip(y_R, wt_R, add_R, strict=True)])):
                        src_vals_R = [v.to(torch.bfloat16).float() for v in vals_R]
                        bound = _order_bound(plan, vals_R, src_vals_R)
                        diff = (out[name].double() - outs["torch", "source"][name].double()).abs()
                        if not bool((diff <= bound).all()):
                            errors.append(f"case {case} {name}: destination vs source {float((diff - bound).max())} "
                                          "past the bound")
                    y_source = outs["torch", "source"]["y"]
                    if world == 1:  # one rank: one partial per token, the source's order exactly
                        errors.append(_mismatch(f"case {case} R=1 destination == source", out["y"], y_source))
            for reduce in ("source", "destination"):
                want, got = outs["torch", reduce], outs["triton", reduce]
                for name in want:
                    errors.append(_mismatch(f"case {case} {reduce} triton {name}", got[name], want[name]))
        return [e for e in errors if e is not None]
    finally:
        for buf in bufs.values():
            buf.destroy()


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_destination_reduce_matches_spec_and_kernels(world: int) -> None:
    errors = run_ranks(_combine_rank, world, timeout_s=300)
    assert errors == [[]] * world, errors


def _entries_rank(rank: int, world: int) -> list[str]:
    from moonep import Buffer
    from moonep.routing import generate_routing

    E, s = 4 * world, 20
    cfg = BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4, entries=True,
                       options=BufferOptions(kernels="torch", combine_reduce="destination"))
    errors: list[str | None] = []
    with Buffer(cfg) as buf:
        topk = generate_routing(num_ranks=world, tokens_per_rank=s, num_experts=E, topk=K, target_maxvio=0.5,
                                seed=9).topk_RsK[rank].clone()
        absent = torch.rand(s, K, generator=torch.Generator().manual_seed(rank)) < 0.35
        absent[0] = True  # a row with no entry at all
        topk[absent] = -1
        x = _rows(s, 7 + rank)
        plan = buf.dispatch(x, torch.rand(s, K), topk).plan
        n = plan.nvs_s
        y_R = [_rows(n, 300 + d) for d in range(world)]
        sc_R = [torch.randn(n, generator=torch.Generator().manual_seed(400 + d)) for d in range(world)]
        y, scal = buf.combine(plan, y_R[rank], row_scalars=sc_R[rank])
        want_y, want_sc = _naive(rank, world, [plan if d == rank else None for d in range(world)],
                                 [v.float() for v in y_R], sc_R, buf.layout.trash_row)
        errors += [_mismatch("entries y", y, want_y), _mismatch("entries scalars", scal, want_sc)]
        # the new inputs are checked like the others (every rank alike, before anything moves)
        for kwargs, match in (({"row_weights": torch.ones(n, dtype=torch.bfloat16)}, "row_weights has dtype"),
                              ({"add_rows": y_R[rank][:-1]}, "add_rows has shape")):
            try:
                buf.combine(plan, y_R[rank], **kwargs)
                errors.append(f"{match}: accepted")
            except ValueError as err:
                if match not in str(err):
                    errors.append(f"{match}: {err}")
    return [e for e in errors if e is not None]


def test_destination_reduce_entries_mode() -> None:
    errors = run_ranks(_entries_rank, 2, timeout_s=120)
    assert errors == [[], []], errors


def test_combine_reduce_option_is_validated() -> None:
    assert BufferOptions().combine_reduce == "source"
    with pytest.raises(ValueError, match=r"combine_reduce must be one of \('source', 'destination'\), got 'dest'"):
        BufferOptions(combine_reduce="dest")


# ------------------------------------------------------------------ the destination push's kernels alone

def _chains(nvs_s: int, topk: int, num_ranks: int, max_tokens: int, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Receive rows as a dispatch leaves them: row_link [nvs_s + 1, 2] (row_src of every row, -1 on
    padding rows) and row_chain [nvs_s + 1] (2 * next + first per token's rows here, ascending k; random
    bits on padding rows), and the chains as lists of rows. Tokens hold 1..topk of their entries here;
    about a fifth of the rows are padding."""
    g = torch.Generator().manual_seed(seed)
    row_link = torch.zeros(nvs_s + 1, 2, dtype=torch.int32)
    row_chain = torch.randint(-(2**20), 2**20, (nvs_s + 1,), generator=g, dtype=torch.int32)  # padding: noise
    row_link[:, 1] = -1
    free = torch.randperm(nvs_s, generator=g).tolist()[: nvs_s - nvs_s // 5]
    chains: list[list[int]] = []
    slots = torch.randperm(num_ranks * max_tokens, generator=g).tolist()  # (source rank, token), each once
    while free:
        m = min(len(free), int(torch.randint(1, topk + 1, (1,), generator=g)))
        ks = sorted(torch.randperm(topk, generator=g)[:m].tolist())
        slot = slots.pop()
        rows = [free.pop() for _ in ks]
        for i, (k, row) in enumerate(zip(ks, rows, strict=True)):
            nxt = rows[i + 1] if i + 1 < len(rows) else -1
            row_link[row, 1] = slot * topk + k  # src_rank * S * K + t * K + k
            row_chain[row] = 2 * nxt + (1 if i == 0 else 0)
        chains.append(rows)
    return row_link, row_chain, chains


@pytest.mark.parametrize("topk", [1, 4, 16])
def test_chain_lists_match_a_walk_of_the_chains(topk: int) -> None:
    from moonep.kernels import dispatch_combine

    segment, nvs_s = 16, 150  # 10 segments, the last one partial
    row_link, row_chain, chains = _chains(nvs_s, topk, num_ranks=2, max_tokens=nvs_s, seed=topk)
    head = {rows[0]: rows for rows in chains}
    want_list = torch.full((nvs_s + 7, topk), -7, dtype=torch.int32)  # rows past nvs_s stay untouched
    want_list[:nvs_s] = -1
    want_count = torch.full((-(-(nvs_s + 7) // segment),), -7, dtype=torch.int32)
    for g0 in range(0, nvs_s, segment):
        primaries = [r for r in range(g0, min(g0 + segment, nvs_s)) if r in head]
        for i, r in enumerate(primaries):
            want_list[g0 + i, : len(head[r])] = torch.tensor(head[r], dtype=torch.int32)
        want_count[g0 // segment] = len(primaries)
    row_list = torch.full_like(want_list, -7)
    count = torch.full_like(want_count, -7)
    dispatch_combine.chain_lists(row_link, row_chain, nvs_s, row_list, count, segment=segment)
    assert _mismatch("count", count, want_count) is None, _mismatch("count", count, want_count)
    assert _mismatch("row_list", row_list, want_list) is None, _mismatch("row_list", row_list, want_list)


@pytest.mark.parametrize(("topk", "scal", "add", "weights"),
                         [(4, False, False, False), (4, True, False, True), (4, True, True, True),
                          (1, True, False, False), (16, False, True, True)])
def test_push_reduce_matches_the_chains_sums(topk: int, scal: bool, add: bool, weights: bool) -> None:
    """The reduce push over several segments, blocks and hidden tiles (segment 16, blocks of 4
    primaries x 512, 3 programs) against the chains summed in PyTorch (push's documented order)."""
    from moonep.datapath.reference import row_values
    from moonep.kernels import dispatch_combine

    R, S, nvs_s, width = 2, 60, 150, 1100
    row_link, row_chain, chains = _chains(nvs_s, topk, num_ranks=R, max_tokens=S, seed=31 + topk)
    SK = S * topk
    y = _rows(nvs_s + 1, 1, width)
    add_rows = _rows(nvs_s + 1, 2, width) if add else None
    w = torch.rand(nvs_s + 1, generator=torch.Generator().manual_seed(3)) if weights else None
    sc = torch.randn(nvs_s + 1, generator=torch.Generator().manual_seed(4)) if scal else None
    land = torch.full((R, SK + 1, width), 1234.0, dtype=torch.bfloat16)  # untouched where nothing lands
    land_scal = torch.full((R, SK + 1), -9.0)
    want, want_scal = land.clone(), land_scal.clone()
    vals = row_values(y, w, add_rows)
    for rows in chains:
        acc = vals[rows[0]].clone()
        for row in rows[1:]:
            acc = acc + vals[row]
        src = int(row_link[rows[0], 1])
        want[src // SK, src % SK] = acc.to(torch.bfloat16)
        for row in rows:
            src = int(row_link[row, 1])
            if sc is not None:
                want_scal[src // SK, src % SK] = sc[row]
    dispatch_combine.push(y, sc, row_link, nvs_s, land, land_scal, SK, 3, row_chain=row_chain,
                          scratch=dispatch_combine.chain_scratch(nvs_s, topk, y.device, segment=16),
                          row_weights=w, add_rows=add_rows, reduce_tile=2048, segment=16)
    assert _mismatch("land", land, want) is None, _mismatch("land", land, want)
    assert _mismatch("land_scalar", land_scal, want_scal) is None, _mismatch("land_scalar", land_scal, want_scal)
