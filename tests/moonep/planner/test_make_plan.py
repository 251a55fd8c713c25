"""The planner (docs/moonep.md §5) on many routings, in one process: make_plan is called for every rank of an
R-rank problem with the gathered histograms, exactly as each rank would call it.

Two kinds of checks:
- properties stated in §5 (exact caps, conservation, one remote home group per rank, slots,
  padded offsets, destinations covering exactly the valid rows, dedup), checked on the plan;
- bitwise equality of every integer output with tests/moonep/helpers/planner_reference.py, an independent
  plain-Python implementation of §5.2-§5.5 (it fixes token order, tie-breaking and slot order).

Legend: R ranks, E experts, epn = E / R, B slots per rank, K top-k, s tokens per rank.
"""

from __future__ import annotations

import random

import pytest
import torch

from moonep import BufferConfig, make_plan
from moonep.layout import Layout
from moonep.planner import Plan
from moonep.planner.reference import receive_caps
from moonep.routing import expert_maxvio, max_maxvio
from tests.moonep.helpers.planner_reference import RefPlan, reference_caps, reference_plan, round_up

GRANULARITY = 4096
NUM_RANDOM = 200


# ---------------------------------------------------------------------------------- helpers
def first_mismatch(got, ref, path: str = "") -> str | None:
    """Path and values of the first difference between two nested lists (None when equal)."""
    if got == ref:
        return None
    if isinstance(ref, list):
        if not isinstance(got, list) or len(got) != len(ref):
            return f"{path}: length {len(got) if isinstance(got, list) else got!r} != {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            m = first_mismatch(g, r, f"{path}[{i}]")
            if m is not None:
                return m
        return None
    return None if got == ref else f"{path}: got {got!r}, reference {ref!r}"


def assert_same(name: str, got: torch.Tensor | list, ref: list, context: str) -> None:
    got_list = got.tolist() if isinstance(got, torch.Tensor) else got
    m = first_mismatch(got_list, ref)
    assert m is None, f"{context}: {name} differs from the independent reference at {name}{m}"


def layout_for(R: int, E: int, K: int, S: int, pad: int, num_slots: int | None = None, entries: bool = False
               ) -> Layout:
    cfg = BufferConfig(max_tokens=S, hidden=8, topk=K, num_experts=E, token_padding=pad, num_slots=num_slots,
                       entries=entries)
    return Layout(cfg, R, GRANULARITY)


def histograms(topk_R: list[torch.Tensor], E: int) -> torch.Tensor:
    ids = [t.reshape(-1).long() for t in topk_R]  # -1 (an absent entry, entries mode) counts nowhere
    return torch.stack([torch.bincount(i[i >= 0], minlength=E) for i in ids]).to(torch.int32)


def plans_for_all_ranks(layout: Layout, topk_R: list[torch.Tensor], total: int | None) -> list[Plan]:
    counts_RE = histograms(topk_R, layout.config.num_experts)
    return [make_plan(layout, r, topk_R[r], counts_RE.clone(), total_num_tokens=total) for r in range(len(topk_R))]


def skewed_routing(gen: torch.Generator, s_R: list[int], E: int, K: int, sigma: float) -> list[torch.Tensor]:
    """K distinct experts per token drawn from log-normal popularity (Gumbel top-k)."""
    log_p = sigma * torch.randn(E, generator=gen)
    out = []
    for s in s_R:
        g = -torch.empty(s, E).exponential_(generator=gen).log()
        out.append((log_p + g).topk(K, dim=1).indices.to(torch.int32).contiguous())
    return out


# ---------------------------------------------------------------------------------- checks
def check_properties(layout: Layout, plans: list[Plan], topk_R: list[torch.Tensor], ctx: str) -> None:
    """§5 properties, on the library's plans alone."""
    R, E, K = layout.num_ranks, layout.config.num_experts, layout.config.topk
    B, epn, pad = layout.num_slots, layout.epn, layout.config.token_padding
    p0 = plans[0]
    # identical shared fields whichever rank computed them
    for r, p in enumerate(plans):
        for name, t in p.shared().items():
            ref = p0.shared()[name]
            assert t.dtype == ref.dtype and torch.equal(t, ref), \
                f"{ctx}: shared field {name} differs between rank 0 and rank {r}: {ref.tolist()} vs {t.tolist()}"
        assert p.nvs_s == p0.nvs_s, f"{ctx}: nvs_s differs across ranks"
    alloc = p0.alloc_ER.long()
    count_E = histograms(topk_R, E).long().sum(0)
    assert bool((alloc >= 0).all()), f"{ctx}: negative alloc {alloc.tolist()}"
    got = alloc.sum(0)
    assert torch.equal(got, p0.cap_R), f"{ctx}: sum_e alloc[e,d] = {got.tolist()} != cap {p0.cap_R.tolist()}"
    got = alloc.sum(1)
    assert torch.equal(got, count_E), f"{ctx}: sum_d alloc[e,d] = {got.tolist()} != count_e {count_E.tolist()}"
    home_E = torch.arange(E) // epn
    for d in range(R):
        remote = (alloc[:, d] > 0) & (home_E != d)
        groups = sorted(set(home_E[remote].tolist()))
        assert len(groups) <= 1, f"{ctx}: rank {d} receives from remote home groups {groups}"
        # the bound the heap's slot rows are sized by (Layout.remote_experts: epn, none on one rank)
        assert int(remote.sum()) <= layout.remote_experts == (epn if R > 1 else 0), \
            f"{ctx}: rank {d} computes {int(remote.sum())} remote experts > {layout.remote_experts}"
        slots = p0.slot_expert_RB[d].tolist()
        used = [e for e in slots if e >= 0]
        assert slots == used + [-1] * (B - len(used)), f"{ctx}: rank {d} slots {slots} not packed"
        assert used == sorted(used) and len(set(used)) == len(used), f"{ctx}: rank {d} slots {slots} not ascending"
        assert len(used) <= B
        for e in used:
            assert alloc[e, d] > 0 and e // epn != d, f"{ctx}: rank {d} slot expert {e} is local or unused"
        if B >= layout.remote_experts:  # training: every remote expert with tokens here has a slot
            assert used == torch.nonzero(remote).flatten().tolist(), f"{ctx}: rank {d} slots {used}"
    # offsets: nondecreasing, every group padded, within nvs_s
    rows = p0.group_rows_RG.long()
    offs = p0.offs_RG.long()
    padded = (rows + pad - 1) // pad * pad
    assert torch.equal(torch.diff(offs, dim=1, prepend=torch.zeros(R, 1, dtype=torch.long)), padded), \
        f"{ctx}: offs {offs.tolist()} are not the padded cumsum of {rows.tolist()}"
    assert bool((offs[:, -1] <= p0.nvs_s).all()) and p0.nvs_s <= layout.nvs, \
        f"{ctx}: last offs {offs[:, -1].tolist()} vs nvs_s {p0.nvs_s} vs NvS {layout.nvs}"
    assert torch.equal(rows.sum(1), p0.cap_R), f"{ctx}: group rows {rows.sum(1).tolist()} != cap"
    for p in plans:
        lo = p.rank * epn
        want = torch.cat([p.offs_RG[p.rank, lo:lo + epn], p.offs_RG[p.rank, E:]])
        assert torch.equal(p.cu_seqlens, want) and p.cu_seqlens.dtype == torch.int32
        if B >= layout.remote_experts:  # every group of this rank is a local expert or a slot: compact offs end at the total
            assert int(p.cu_seqlens[-1]) == int(offs[p.rank, -1]), f"{ctx}: cu_seqlens {p.cu_seqlens.tolist()}"
    # destinations: distinct and exactly the valid rows of every rank
    valid = [set() for _ in range(R)]
    for d in range(R):
        start = 0
        for g in range(E + B):
            valid[d].update(range(start, start + int(rows[d, g])))
            start = int(offs[d, g])
    seen: list[set[int]] = [set() for _ in range(R)]
    for p, topk in zip(plans, topk_R, strict=True):
        for dr, row, e in zip(p.dst_rank_sK.reshape(-1).tolist(), p.dst_row_sK.reshape(-1).tolist(),
                              topk.reshape(-1).tolist(), strict=True):
            if e < 0:  # absent entry: nowhere (this rank's trash row)
                assert (dr, row) == (p.rank, layout.trash_row), f"{ctx}: absent entry sent to ({dr}, {row})"
                continue
            assert row not in seen[dr], f"{ctx}: (rank {dr}, row {row}) is the destination of two entries"
            seen[dr].add(row)
    for d in range(R):
        assert seen[d] == valid[d], (f"{ctx}: rank {d} destinations {sorted(seen[d] ^ valid[d])[:8]} "
                                     "are not exactly its valid rows")
    # dedup: `sent` = lowest k per (token, destination rank); copy_row = that entry's row
    for p, topk in zip(plans, topk_R, strict=True):
        dr, row = p.dst_rank_sK.long(), p.dst_row_sK.long()
        present = topk >= 0
        same = (dr[:, :, None] == dr[:, None, :]) & present[:, :, None] & present[:, None, :]
        lower = torch.arange(K)[None, :] < torch.arange(K)[:, None]  # [k, k']: k' < k
        has_lower = (same & lower[None]).any(2)
        assert torch.equal(p.sent_sK, ~has_lower & present), f"{ctx}: rank {p.rank} sent {p.sent_sK.tolist()}"
        first = torch.argmax(same.to(torch.int8), dim=2)
        want = torch.where(present, row.gather(1, first), layout.trash_row)
        assert torch.equal(p.copy_row_sK.long(), want), f"{ctx}: rank {p.rank} copy_row"


def check_against_reference(layout: Layout, plans: list[Plan], topk_R: list[torch.Tensor], total: int | None,
                            ctx: str) -> RefPlan:
    E, B, pad = layout.config.num_experts, layout.num_slots, layout.config.token_padding
    absent_row = layout.trash_row if layout.config.entries else None
    ref = reference_plan([t.tolist() for t in topk_R], E, B, pad, total, absent_row)
    p0 = plans[0]
    assert p0.nvs_s == ref.nvs_s, f"{ctx}: nvs_s {p0.nvs_s} != reference {ref.nvs_s}"
    assert_same("cap_R", p0.cap_R, ref.cap, ctx)
    assert_same("quota_RR", p0.quota_RR, ref.quota, ctx)
    assert_same("alloc_ER", p0.alloc_ER, ref.alloc, ctx)
    assert_same("slot_expert_RB", p0.slot_expert_RB, ref.slot_expert, ctx)
    assert_same("group_rows_RG", p0.group_rows_RG, ref.group_rows, ctx)
    assert_same("offs_RG", p0.offs_RG, ref.offs, ctx)
    for r, p in enumerate(plans):
        c = f"{ctx} rank {r}"
        assert_same("dst_rank_sK", p.dst_rank_sK, ref.dst_rank[r], c)
        assert_same("dst_row_sK", p.dst_row_sK, ref.dst_row[r], c)
        assert_same("copy_row_sK", p.copy_row_sK, ref.copy_row[r], c)
        assert_same("sent_sK", p.sent_sK, ref.sent[r], c)
        assert p.num_tokens == topk_R[r].shape[0]
    assert p0.dst_rank_sK.dtype == p0.dst_row_sK.dtype == p0.copy_row_sK.dtype == torch.int32
    assert p0.alloc_ER.dtype == p0.slot_expert_RB.dtype == p0.offs_RG.dtype == torch.int32
    return ref


def check_problem(R: int, E: int, K: int, pad: int, topk_R: list[torch.Tensor], total: int | None, ctx: str,
                  num_slots: int | None = None) -> tuple[list[Plan], RefPlan]:
    S = max(t.shape[0] for t in topk_R)
    layout = layout_for(R, E, K, S, pad, num_slots)
    plans = plans_for_all_ranks(layout, topk_R, total)
    check_properties(layout, plans, topk_R, ctx)
    ref = check_against_reference(layout, plans, topk_R, total, ctx)
    return plans, ref


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_random_routings_match_reference_and_properties(R: int) -> None:
    rng = random.Random(1000 + R)
    gen = torch.Generator().manual_seed(2000 + R)
    num_slot_use = 0
    for case in range(NUM_RANDOM):
        epn = rng.choice([1, 2, 3, 4, 6])
        E = R * epn
        K = rng.randint(1, min(E, 8))
        pad = rng.choice([1, 2, 4, 8, 16])
        sigma = rng.choice([0.0, 0.5, 1.0, 2.0, 4.0])
        per_rank = R > 1 and rng.random() < 0.3
        s = rng.randint(1, 40)
        s_R = [rng.randint(1, 40) for _ in range(R)] if per_rank else [s] * R
        total = sum(s_R) if per_rank else None
        topk_R = skewed_routing(gen, s_R, E, K, sigma)
        ctx = f"R={R} case {case} (E={E}, K={K}, pad={pad}, sigma={sigma}, s={s_R}, total={total})"
        plans, _ = check_problem(R, E, K, pad, topk_R, total, ctx)
        num_slot_use += int((plans[0].slot_expert_RB >= 0).any())
    if R > 1:  # the sample must exercise redundant experts, or the slot checks test nothing
        assert num_slot_use > NUM_RANDOM // 2, f"only {num_slot_use} of {NUM_RANDOM} routings used a slot"


def _same_k_experts(R: int, s: int, experts: list[int]) -> list[torch.Tensor]:
    return [torch.tensor([experts] * s, dtype=torch.int32) for _ in range(R)]


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_adversarial_routings(R: int) -> None:
    cases: list[tuple[str, int, int, int, list[torch.Tensor], int | None]] = []
    for epn, K in ((1, 1), (2, 2), (4, 3), (8, 8), (6, 4)):
        E = R * epn
        if K > E:
            continue
        for s in (1, 5, 33):
            for where in ("first", "last", "spread"):
                if where == "first":
                    experts = list(range(K))
                elif where == "last":
                    experts = list(range(E - K, E))
                else:
                    experts = [(i * E) // K for i in range(K)]
                topk_R = _same_k_experts(R, s, experts)
                counts = histograms(topk_R, E).sum(0)
                assert abs(expert_maxvio(counts) - max_maxvio(E, K)) < 1e-9
                cases.append((f"all tokens to experts {experts}", E, K, 4, topk_R, None))
    gen = torch.Generator().manual_seed(77)
    for E in (R, 2 * R, 4 * R):
        # K = E: every token to every expert
        for s in (1, 3):
            topk_R = [torch.stack([torch.randperm(E, generator=gen) for _ in range(s)]).to(torch.int32)
                      for _ in range(R)]
            cases.append(("K = E", E, E, 2, topk_R, None))
    for pad in (1, 64):  # padding 1, and padding larger than every group
        topk_R = skewed_routing(gen, [7] * R, 4 * R, 3, 3.0)
        cases.append((f"token_padding={pad}", 4 * R, 3, pad, topk_R, None))
    if R > 1:
        # per-rank s: extreme imbalance of token counts, with and without expert skew
        for s_R in ([1] + [40] * (R - 1), [40] + [1] * (R - 1), list(range(1, R + 1)), [3] * R):
            for sigma in (0.0, 4.0):
                topk_R = skewed_routing(gen, s_R, 2 * R, 3, sigma)
                cases.append((f"per-rank s={s_R} sigma={sigma}", 2 * R, 3, 4, topk_R, sum(s_R)))
            topk_R = _same_k_experts(R, 1, [0, 1, 2])
            topk_R = [t.repeat(n, 1) for t, n in zip(topk_R, s_R, strict=True)]
            cases.append((f"per-rank s={s_R} all to experts 0-2", 2 * R, 3, 4, topk_R, sum(s_R)))
    for name, E, K, pad, topk_R, total in cases:
        ctx = f"R={R} adversarial {name} (E={E}, K={K}, pad={pad}, s={[t.shape[0] for t in topk_R]})"
        check_problem(R, E, K, pad, topk_R, total, ctx)


def test_maximum_maxvio_uses_every_slot_of_the_receivers() -> None:
    """All tokens to experts 0..K-1 (home rank 0) at K = epn: every other rank processes only
    rank 0's experts, so each takes every one of its B = epn slots... or as many as it needs."""
    R, epn, s = 4, 4, 16
    E, K = R * epn, epn
    topk_R = _same_k_experts(R, s, list(range(K)))
    plans, _ = check_problem(R, E, K, 4, topk_R, None, "max maxvio")
    slots = plans[0].slot_expert_RB
    assert (slots[0] == -1).all(), f"rank 0 owns the hot experts and needs no slot: {slots.tolist()}"
    for d in range(1, R):
        used = slots[d][slots[d] >= 0].tolist()
        assert used and all(e < epn for e in used), f"rank {d} slots {used}"
    # every rank processes exactly s*K entries although rank 0's group holds all R*s*K
    assert plans[0].cap_R.tolist() == [s * K] * R
    assert plans[0].alloc_ER[:epn].sum().item() == R * s * K


def test_fewer_slots_than_remote_experts_keeps_home_rows() -> None:
    """Inference (B < epn): remote experts past the B-th keep their home W_full row (§5.4)."""
    gen = torch.Generator().manual_seed(5)
    overflow = 0
    R, epn, K = 4, 6, 4
    for case in range(40):
        # tokens only for rank 0's experts, spread evenly: receivers need several of them
        topk_R = [torch.stack([torch.randperm(epn, generator=gen)[:K] for _ in range(24)]).to(torch.int32)
                  for _ in range(R)]
        if case % 2:  # and a random remainder elsewhere
            topk_R = [torch.where(torch.rand(24, 1, generator=gen) < 0.5, t, t + epn * (1 + case % (R - 1)))
                      for t in topk_R]
        plans, _ = check_problem(R, R * epn, K, 4, topk_R, None, f"B=2 case {case}", num_slots=2)
        alloc, slots = plans[0].alloc_ER, plans[0].slot_expert_RB
        for d in range(R):
            remote = [e for e in range(R * epn) if alloc[e, d] > 0 and e // epn != d]
            assert slots[d].tolist() == [*remote[:2], -1, -1][:2], f"case {case} rank {d}"
            for e in remote[2:]:  # no slot: its tokens sit in the group of W_full row e
                overflow += 1
                assert int(plans[0].group_rows_RG[d, e]) == int(alloc[e, d])
    assert overflow > 0, "no routing needed more than B remote experts; the test checks nothing"


@pytest.mark.parametrize(("T", "K", "R"), [(5, 3, 4), (8, 2, 4), (1, 1, 8), (13, 8, 8), (7, 5, 2), (9, 1, 1)])
def test_receive_caps_per_rank_s(T: int, K: int, R: int) -> None:
    """§5.1: cap_d = floor(T*K/R) + (1 if d < (T*K) mod R else 0)."""
    want = [T * K // R + (1 if d < (T * K) % R else 0) for d in range(R)]
    assert want == reference_caps(R, K, [0] * R, T)
    got = receive_caps(R, K, num_tokens=None, total_num_tokens=T, device=torch.device("cpu"))
    assert got.tolist() == want and got.dtype == torch.int64
    assert sum(want) == T * K and max(want) - min(want) <= 1
    same = receive_caps(R, K, num_tokens=T, total_num_tokens=None, device=torch.device("cpu"))
    assert same.tolist() == [T * K] * R


def test_per_rank_s_caps_and_nvs_in_the_plan() -> None:
    R, E, K = 4, 8, 3
    s_R = [1, 2, 2, 0 + 2]  # T = 7, T*K = 21 = 4*5 + 1
    gen = torch.Generator().manual_seed(3)
    topk_R = skewed_routing(gen, s_R, E, K, 1.0)
    plans, _ = check_problem(R, E, K, 4, topk_R, sum(s_R), "per-rank s caps")
    assert plans[0].cap_R.tolist() == [6, 5, 5, 5]
    layout = layout_for(R, E, K, max(s_R), 4)
    assert all(p.nvs_s == layout.nvs_rows(6) == round_up(6 + 2 * 2 * 3, 4) for p in plans)


def entries_routing(gen: torch.Generator, R: int, s: int, E: int, K: int, sigma: float, absent: float
                    ) -> list[torch.Tensor]:
    """Skewed routing with each entry absent (-1) with probability `absent`, and the last row of every rank
    without any entry (a padding row of the hierarchical host stage)."""
    out = []
    for topk in skewed_routing(gen, [s] * R, E, K, sigma):
        drop = torch.rand(topk.shape, generator=gen) < absent
        drop[-1] = True
        out.append(torch.where(drop, -1, topk).to(torch.int32).contiguous())
    return out


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_entries_mode_matches_reference_and_properties(R: int) -> None:
    """Entries mode (BufferConfig.entries): rows with 0 to K entries, caps split the total entries T
    (floor(T/R), the remainder to the lowest ranks), every field bitwise the independent reference's."""
    rng = random.Random(3000 + R)
    gen = torch.Generator().manual_seed(4000 + R)
    uneven = slot_use = 0
    for case in range(NUM_RANDOM // 2):
        epn = rng.choice([1, 2, 3, 4])
        E = R * epn
        K = rng.randint(1, min(E, 6))
        pad = rng.choice([1, 4, 8])
        sigma = rng.choice([0.0, 1.0, 4.0])
        s = rng.randint(1, 30)
        absent = rng.choice([0.0, 0.3, 0.7, 1.0])
        topk_R = entries_routing(gen, R, s, E, K, sigma, absent)
        ctx = f"R={R} entries case {case} (E={E}, K={K}, pad={pad}, sigma={sigma}, s={s}, absent={absent})"
        layout = layout_for(R, E, K, s, pad, entries=True)
        plans = plans_for_all_ranks(layout, topk_R, None)
        check_properties(layout, plans, topk_R, ctx)
        check_against_reference(layout, plans, topk_R, None, ctx)
        T = sum(int((t >= 0).sum()) for t in topk_R)
        assert plans[0].cap_R.tolist() == [T // R + (d < T % R) for d in range(R)], ctx
        assert all(p.nvs_s == layout.call_rows(s, None) for p in plans), ctx
        uneven += T % R != 0
        slot_use += int((plans[0].slot_expert_RB >= 0).any())
    assert uneven > 0 or R == 1, "no case had T % R != 0: the remainder rule went untested"
    if R > 1:
        assert slot_use > NUM_RANDOM // 8, f"only {slot_use} entries-mode routings used a slot"


def test_entries_mode_rejects_bad_input() -> None:
    layout = layout_for(2, 4, 2, 3, 4, entries=True)
    topk = torch.tensor([[0, -1], [-1, -1], [3, 1]], dtype=torch.int32)
    counts = histograms([topk, topk], 4)
    assert counts.sum().item() == 6
    with pytest.raises(ValueError, match="does not apply to an entries-mode buffer"):
        make_plan(layout, 0, topk, counts, total_num_tokens=6)
    with pytest.raises(ValueError, match=r"outside \[-1, 4\)"):
        make_plan(layout, 0, torch.where(topk < 0, -2, topk), counts)
    with pytest.raises(ValueError, match="routes to the same expert twice"):
        make_plan(layout, 0, torch.tensor([[1, 1], [-1, -1], [3, 1]], dtype=torch.int32), counts)
    with pytest.raises(ValueError, match=r"more than s\*K=4"):  # rank 1 claims 5 entries on 2 rows of K=2
        make_plan(layout, 0, topk[:2], torch.tensor([[1, 0, 0, 0], [2, 1, 1, 1]], dtype=torch.int32))
    plain = layout_for(2, 4, 2, 3, 4)  # outside entries mode a row has K entries
    with pytest.raises(ValueError, match=r"not s\*K for a whole number of tokens"):
        make_plan(plain, 0, topk, counts)


def test_plan_is_frozen_and_printable() -> None:
    gen = torch.Generator().manual_seed(9)
    topk_R = skewed_routing(gen, [4, 4], 4, 2, 2.0)
    plans, _ = check_problem(2, 4, 2, 4, topk_R, None, "repr")
    text = repr(plans[1])
    assert "rank=1/2" in text and f"cap_R={plans[1].cap_R.tolist()}" in text
    with pytest.raises(AttributeError):
        plans[1].num_tokens = 3  # type: ignore[misc]
