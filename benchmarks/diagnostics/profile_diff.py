"""Two profiled steps compared kernel by kernel: the "every kernel" tables train_diagnostics writes (bench_train
--profile) read back, per kernel name and per class the count and ms of each and the difference, largest first;
kernels only one of them ran are marked gone or new.

    python benchmarks/diagnostics/profile_diff.py BEFORE.txt AFTER.txt [--top 40]

A file may hold several ranks' tables (one "===== rank r" section each): --rank picks one (default 0). A kernel
name is compared as written (inductor's generated names carry a per-graph index, so a changed graph can rename
its kernels: their class totals still compare).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)\s{2}(.{20}) (.+)$")


def kernel_rows(text: str, rank: int = 0) -> dict[str, tuple[str, int, float]]:
    """{name: (class, count, ms)} of one rank's "every kernel" table (names as printed: their first 160 characters)."""
    sections = re.split(r"^===== rank (\d+)\s*$", text, flags=re.M)
    by_rank = {int(sections[i]): sections[i + 1] for i in range(1, len(sections) - 1, 2)} or {0: text}
    if rank not in by_rank:
        raise ValueError(f"no '===== rank {rank}' section in the profile; it has ranks {sorted(by_rank)}")
    body = by_rank[rank]
    start = body.find("every kernel (count, total ms, class, name):")
    if start < 0:
        raise ValueError("no 'every kernel' table in the profile: write one with bench_train.py --profile")
    rows: dict[str, tuple[str, int, float]] = {}
    for line in body[start:].splitlines()[1:]:
        m = _ROW.match(line)
        if m is None:
            break
        name, (cls, n, ms) = m.group(4), (m.group(3).strip(), int(m.group(1)), float(m.group(2)))
        if name in rows:  # the table prints 160 characters of a name: kernels sharing them add up here
            n, ms = n + rows[name][1], ms + rows[name][2]
        rows[name] = (cls, n, ms)
    return rows


def diff_lines(before: dict[str, tuple[str, int, float]], after: dict[str, tuple[str, int, float]],
               top: int) -> list[str]:
    """The class totals, then the `top` kernels whose ms changed most."""
    classes: dict[str, list[float]] = {}
    for side, rows in enumerate((before, after)):
        for cls, _, ms in rows.values():
            classes.setdefault(cls, [0.0, 0.0])[side] += ms
    lines = [f"{'class':20s} {'before ms':>10} {'after ms':>10} {'diff':>9}"]
    for cls, (b, a) in sorted(classes.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])):
        lines.append(f"{cls:20s} {b:10.3f} {a:10.3f} {a - b:+9.3f}")
    total_b, total_a = sum(v[0] for v in classes.values()), sum(v[1] for v in classes.values())
    lines.append(f"{'all kernels':20s} {total_b:10.3f} {total_a:10.3f} {total_a - total_b:+9.3f}")
    lines.append("")
    lines.append(f"{'count':>11} {'before ms':>10} {'after ms':>10} {'diff':>9}  kernel")
    names = sorted(set(before) | set(after),
                   key=lambda n: -abs(after.get(n, ("", 0, 0.0))[2] - before.get(n, ("", 0, 0.0))[2]))
    for name in names[:top]:
        _, nb, b = before.get(name, ("", 0, 0.0))
        _, na, a = after.get(name, ("", 0, 0.0))
        mark = " (gone)" if name not in after else " (new)" if name not in before else ""
        lines.append(f"{nb:5d}>{na:<5d} {b:10.3f} {a:10.3f} {a - b:+9.3f}  {name[:110]}{mark}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    before = kernel_rows(Path(args.before).read_text(), args.rank)
    after = kernel_rows(Path(args.after).read_text(), args.rank)
    print("\n".join(diff_lines(before, after, args.top)))


if __name__ == "__main__":
    main()
