"""kda_counters' reading of ncu's raw CSV (the profiling needs a GPU; this is its bookkeeping): ncu's own lines
before the header skipped, each kernel's fields found by metric name and scaled by the units row, the three
largest stalls kept by value, a missing metric left None, and input with no header refused by name."""

from __future__ import annotations

import pytest

from benchmarks.diagnostics import kda_counters as kc

HEADER = ['ID', 'Kernel Name', 'gpu__time_duration.sum', 'dram__bytes_read.sum', 'dram__bytes_write.sum',
          'launch__registers_per_thread', 'smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_wait_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio']
UNITS = ['', '', 'usecond', 'Mbyte', 'Gbyte', 'register/thread', 'ratio', 'ratio', 'ratio', 'ratio']


def _csv(*rows: list[str]) -> str:
    lines = ['==PROF== Connected to process 1 (python)', ','.join(f'"{h}"' for h in HEADER),
             ','.join(f'"{u}"' for u in UNITS)]
    return '\n'.join(lines + [','.join(f'"{v}"' for v in r) for r in rows]) + '\n'


def test_rows_are_read_by_metric_name_and_unit() -> None:
    text = _csv(['0', '_kblock_kernel', '612.5', '1,024.5', '0.5', '168', '3.25', '0', '1.5', '2.0'],
                ['1', '_finish_kernel', '159', '100', '0.1', '96', '0.5', '4', 'n/a', '0.25'])
    rows = kc.rows_of(text)
    assert [r['kernel'] for r in rows] == ['_kblock_kernel', '_finish_kernel']
    assert rows[0]['ns'] == 612500.0 and rows[1]['ns'] == 159000.0  # usecond -> ns
    assert rows[0]['read'] == 1024.5e6 and rows[0]['write'] == 0.5e9  # thousands' comma and units honoured
    assert rows[0]['registers'] == 168
    assert rows[0]['stalls'] == [(3.25, 'long_scoreboard'), (2.0, 'math_pipe_throttle'), (1.5, 'wait')]
    assert rows[1]['stalls'] == [(4.0, 'barrier'), (0.5, 'long_scoreboard'), (0.25, 'math_pipe_throttle')]
    assert rows[0]['dram_pct'] is None and rows[0]['occupancy'] is None  # not in this CSV


def test_table_totals_the_kernels(capsys) -> None:
    kc.print_table(kc.rows_of(_csv(['0', 'a', '10', '20', '0', '1', '0', '0', '0', '0'],
                                   ['1', 'b', '30', '0', '0.04', '1', '0', '0', '0', '0'])))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ['10.0', '20.0', '2000']  # 20 MB in 10 us: 2000 GB/s
    assert lines[-1].startswith('    40.0 us in 2 kernels')


def test_input_without_a_header_is_refused() -> None:
    with pytest.raises(ValueError, match='no ncu CSV header'):
        kc.rows_of('==ERROR== the profiler failed\n')
