"""An independent, slow reference of the planner (docs/moonep.md §5.1-§5.5) in plain Python loops.

It is written from the text of docs/moonep.md §5, not from moonep/planner.py: integers in lists, one greedy step
per loop iteration, every (source rank, token, k) entry placed one at a time. Tests compare the
library's integer plan to it bitwise and use it to predict where every token row must land.

Legend: R ranks, E experts, epn = E / R, B slots per rank, G = E + B rows of W_full, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass


def _argmax(values: list[int]) -> int:
    """Index of the largest value, lowest index on ties."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _argmin(values: list[int]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v < values[best]:
            best = i
    return best


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass
class RefPlan:
    cap: list[int]  # [R]
    quota: list[list[int]]  # [R][R] z[h][u]
    alloc: list[list[int]]  # [E][R]
    slot_expert: list[list[int]]  # [R][B], -1 when empty
    group_rows: list[list[int]]  # [R][G] unpadded rows of W_full row g on rank d
    offs: list[list[int]]  # [R][G] cumulative padded ends
    nvs_s: int
    # per source rank r: [s_r][K]
    dst_rank: list[list[list[int]]]
    dst_row: list[list[list[int]]]
    copy_row: list[list[list[int]]]
    sent: list[list[list[bool]]]
    # per receiving rank d: row -> (src rank, t, k) of the entry stored there, None for padding
    row_entry: list[list[tuple[int, int, int] | None]]


def reference_caps(num_ranks: int, topk: int, s_R: list[int], total_num_tokens: int | None) -> list[int]:
    """§5.1."""
    if total_num_tokens is None:
        assert all(s == s_R[0] for s in s_R)
        return [s_R[0] * topk] * num_ranks
    T = total_num_tokens
    return [T * topk // num_ranks + (1 if d < (T * topk) % num_ranks else 0) for d in range(num_ranks)]


def reference_plan(topk_R: list[list[list[int]]], num_experts: int, num_slots: int, token_padding: int,
                   total_num_tokens: int | None = None, absent_row: int | None = None) -> RefPlan:
    """The whole plan of every rank from every rank's routing topk_R[r][t][k].

    Entries mode (absent_row given): -1 marks an absent entry; the caps split the T present entries,
    T // R + (1 if d < T % R); nvs_s stays that of s*K entries (every rank has the same s rows); an
    absent entry goes to (its own rank, absent_row), copy_row absent_row, not sent."""
    R, E, B, pad = len(topk_R), num_experts, num_slots, token_padding
    epn = E // R
    K = len(topk_R[0][0])
    s_R = [len(t) for t in topk_R]
    G = E + B

    # 5.1 receive caps
    entries = absent_row is not None
    if entries:
        assert total_num_tokens is None and all(s == s_R[0] for s in s_R)
        T = sum(e >= 0 for r in range(R) for tok in topk_R[r] for e in tok)
        cap = [T // R + (1 if d < T % R else 0) for d in range(R)]
    else:
        cap = reference_caps(R, K, s_R, total_num_tokens)

    # 5.2 receiver filling
    count = [0] * E
    for r in range(R):
        for tok in topk_R[r]:
            for e in tok:
                if e >= 0:
                    count[e] += 1
    group = [sum(count[h * epn:(h + 1) * epn]) for h in range(R)]
    balance = [group[h] - cap[h] for h in range(R)]
    assert sum(balance) == 0
    quota = [[0] * R for _ in range(R)]
    while True:
        h = _argmax(balance)
        u = _argmin(balance)
        if balance[h] <= 0:
            break
        quota[h][u] = -balance[u]
        balance[h] += balance[u]
        balance[u] = 0

    # 5.3 quota to experts
    alloc = [[0] * R for _ in range(E)]
    for h in range(R):
        remaining = count[h * epn:(h + 1) * epn]
        q = list(quota[h])
        while True:
            d = _argmax(q)
            if q[d] == 0:
                break
            le = _argmax(remaining)
            take = min(remaining[le], q[d])
            assert take > 0, "a donor ran out of tokens before its quota was met"
            alloc[h * epn + le][d] += take
            remaining[le] -= take
            q[d] -= take
        for le in range(epn):
            alloc[h * epn + le][h] += remaining[le]

    # 5.4 slots in ascending expert id, W_full row of each (expert, rank), padded offsets
    slot_expert = [[-1] * B for _ in range(R)]
    row_of = [[e] * R for e in range(E)]  # W_full row expert e's tokens use on rank d
    for d in range(R):
        j = 0
        for e in range(E):
            if alloc[e][d] > 0 and e // epn != d:
                if j < B:
                    slot_expert[d][j] = e
                    row_of[e][d] = E + j
                j += 1
    group_rows = [[0] * G for _ in range(R)]
    for e in range(E):
        for d in range(R):
            group_rows[d][row_of[e][d]] += alloc[e][d]
    offs = []
    for d in range(R):
        acc, ends = 0, []
        for g in range(G):
            acc += round_up(group_rows[d][g], pad)
            ends.append(acc)
        offs.append(ends)
    max_cap = s_R[0] * K if entries else max(cap)
    groups = epn if R == 1 else 2 * epn  # its own experts, and at R > 1 those of at most one remote home group
    nvs_s = round_up(max_cap + groups * (pad - 1), pad)

    # 5.5 token destinations: per expert, entries in (source rank, t*K + k) order
    dst_rank = [[[0] * K for _ in range(s_R[r])] for r in range(R)]
    dst_row = [[[0] * K for _ in range(s_R[r])] for r in range(R)]
    seen = [0] * E  # entries of expert e placed so far
    for r in range(R):
        for flat in range(s_R[r] * K):
            t, k = divmod(flat, K)
            e = topk_R[r][t][k]
            if e < 0:  # absent entry (entries mode)
                dst_rank[r][t][k], dst_row[r][t][k] = r, absent_row
                continue
            pos = seen[e]
            seen[e] += 1
            start = 0
            for d in range(R):
                if pos < start + alloc[e][d]:
                    break
                start += alloc[e][d]
            else:
                raise AssertionError("entry beyond the expert's allocation")
            g = row_of[e][d]
            group_start = offs[d][g] - round_up(group_rows[d][g], pad)
            dst_rank[r][t][k] = d
            dst_row[r][t][k] = group_start + pos - start
    copy_row = [[[0] * K for _ in range(s_R[r])] for r in range(R)]
    sent = [[[False] * K for _ in range(s_R[r])] for r in range(R)]
    for r in range(R):
        for t in range(s_R[r]):
            for k in range(K):
                if topk_R[r][t][k] < 0:
                    copy_row[r][t][k] = absent_row
                    continue
                first = min(kk for kk in range(K)
                            if topk_R[r][t][kk] >= 0 and dst_rank[r][t][kk] == dst_rank[r][t][k])
                sent[r][t][k] = first == k
                copy_row[r][t][k] = dst_row[r][t][first]
    row_entry: list[list[tuple[int, int, int] | None]] = [[None] * nvs_s for _ in range(R)]
    for r in range(R):
        for t in range(s_R[r]):
            for k in range(K):
                if topk_R[r][t][k] < 0:
                    continue
                d, row = dst_rank[r][t][k], dst_row[r][t][k]
                assert row < nvs_s and row_entry[d][row] is None, (d, row)
                row_entry[d][row] = (r, t, k)
    return RefPlan(cap, quota, alloc, slot_expert, group_rows, offs, nvs_s, dst_rank, dst_row, copy_row, sent,
                   row_entry)
