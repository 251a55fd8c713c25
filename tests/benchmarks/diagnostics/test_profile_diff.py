"""profile_diff on hand-made "every kernel" tables in train_diagnostics' format (kernel_table writes them; the
GPU run's profile files are read back the same way): the parsed values, rows sharing a printed name added up,
the rank sections, and the class and kernel differences."""

from __future__ import annotations

import pytest

from benchmarks.diagnostics.profile_diff import diff_lines, kernel_rows
from benchmarks.diagnostics.train_diagnostics import kernel_class, kernel_table

NS = 1_000_000  # ns per ms


def _profile(kernels: list[tuple[str, int, float]]) -> str:
    """A profile text around kernel_table's output of (name, count, ms each) kernels."""
    events = [(0, 0, int(ms * NS), name) for name, n, ms in kernels for _ in range(n)]
    return "two steps ...\n  top kernels (count, ms):\n     3    1.00  x\n\n" + kernel_table(events) + "\ntail\n"


def test_rows_classes_and_differences() -> None:
    long = "_ZN7cutlass" + "x" * 200  # two kernels whose first 160 characters agree
    before = kernel_rows(_profile([("nvjet_sm90_a", 2, 1.5), (long + "A", 1, 2.0), (long + "B", 1, 3.0),
                                   ("triton_poi_fused_view_0", 3, 0.25), ("_adamw_write_back_kernel", 1, 4.0)]))
    assert before["nvjet_sm90_a"] == ("gemm", 2, 3.0)
    assert before[long[:160]] == ("gemm", 2, 5.0)  # printed 160 characters: one row of both
    assert before["triton_poi_fused_view_0"] == ("inductor fused", 3, 0.75)
    after = kernel_rows(_profile([("nvjet_sm90_a", 2, 1.25), (long + "A", 2, 2.5),
                                  ("_adamw_write_back_kernel", 1, 4.0), ("_new_kernel", 1, 0.625)]))
    lines = diff_lines(before, after, top=10)
    table = {line.split()[0]: line.split()[1:] for line in lines[1:lines.index("")]}
    assert table["gemm"] == ["8.000", "7.500", "-0.500"]
    assert table["inductor"] == ["fused", "0.750", "0.000", "-0.750"]
    assert lines[lines.index("") - 1].split() == ["all", "kernels", "12.750", "12.125", "-0.625"]
    kernels = lines[lines.index("") + 2:]
    assert kernels[0].split()[:4] == ["3>0", "0.750", "0.000", "-0.750"] and kernels[0].endswith("(gone)")
    assert kernels[1].split()[:4] == ["0>1", "0.000", "0.625", "+0.625"] and kernels[1].endswith("(new)")
    assert any(k.split()[:4] == ["2>2", "3.000", "2.500", "-0.500"] for k in kernels)


def test_rank_sections() -> None:
    text = ("===== rank 0\n" + _profile([("k0", 1, 1.0)]) + "===== rank 1\n" + _profile([("k1", 2, 1.0)]))
    assert kernel_rows(text, rank=1) == {"k1": (kernel_class("k1"), 2, 2.0)}
    with pytest.raises(ValueError, match=r"no '===== rank 2' section in the profile; it has ranks \[0, 1\]"):
        kernel_rows(text, rank=2)
    with pytest.raises(ValueError, match="no 'every kernel' table"):
        kernel_rows("===== rank 0\nnothing\n")
