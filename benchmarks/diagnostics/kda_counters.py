"""KDA's forward + backward kernels under Nsight Compute's hardware counters: what bounds each one (DRAM bytes
against the kernel's time, occupancy, registers, where its warps stall), on the model's route (moontrain's
gate-and-norm ends, dqkg stage and fused intra stage; fla's other stages).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        --csv --page raw python benchmarks/diagnostics/kda_counters.py --run [--case 4x4096x16] > ncu.csv
    python benchmarks/diagnostics/kda_counters.py --table ncu.csv[.xz] [--out counters.json]

--run: five untimed calls (Triton's autotuning and compiles), then one call between cudaProfilerStart and
cudaProfilerStop, the window ncu profiles. --table: one row per kernel of that call, in launch order: time,
DRAM bytes read + written and their rate, the share of DRAM's and of the SMs' peak, achieved occupancy,
registers a thread, and the three largest warp-stall reasons (cycles a warp spends stalled per issued
instruction). `bash launch/gpu_checks.sh OUT kdacounters` runs both;
docs/performance.md reads the table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

UNIT = {"usecond": 1e3, "msecond": 1e6, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}  # to ns and bytes; others as read
STALL = "smsp__average_warps_issue_stalled_"  # the WarpStateStats metrics' prefix (cycles per issued instruction)
COLUMNS = {  # the table's fields: raw metric names, first present wins
    "ns": ("gpu__time_duration.sum",),
    "read": ("dram__bytes_read.sum",),
    "write": ("dram__bytes_write.sum",),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                 "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "occupancy": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "registers": ("launch__registers_per_thread",),
    "grid": ("launch__grid_size",),
    "block": ("launch__block_size",),
}


def run(case: str) -> None:
    """The profiled window: one forward + backward after five untimed ones."""
    import torch

    from moontrain.model.kda.fla_backend import route_fla_stages
    from moontrain.model.kda.ops import kda_fla, random_kda_inputs

    route_fla_stages(dqkg="moontrain", intra="fla_k64")
    B, T, H = (int(x) for x in case.split("x"))
    leaves, kwargs, go = random_kda_inputs(B, T, H, 128, doc_len=None)
    kwargs.update(recompute=False, gate_norm=True, intra_norm=True, walk=True)  # the model's defaults (kernels.kda_*)

    def call() -> None:
        o = kda_fla(*leaves, **kwargs)
        torch.autograd.grad(o, leaves, go)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def rows_of(text: str) -> list[dict]:
    """One dict per profiled kernel from ncu's `--csv --page raw` output (a header row, a units row, then a row
    per kernel; ncu's own lines before the header are skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("kda_counters: no ncu CSV header (a line starting with \"ID\") in the input; was ncu run "
                         "with --csv --page raw, and did it profile any kernel?")
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, body = table[0], table[1], table[2:]
    out = []
    for values in body:
        raw = dict(zip(header, values, strict=False))  # a short row (ncu cut off) keeps what it has
        row = {"kernel": raw.get("Kernel Name", "?")}
        for field, names in COLUMNS.items():
            name = next((n for n in names if n in raw), None)
            value = _number(raw[name]) if name else None
            row[field] = None if value is None else value * UNIT.get(units[header.index(name)], 1)
        stalls = {n[len(STALL):].removesuffix("_per_issue_active.ratio"): _number(raw[n])
                  for n in header if n.startswith(STALL) and n.endswith("_per_issue_active.ratio")}
        row["stalls"] = sorted(((v, k) for k, v in stalls.items() if v), reverse=True)[:3]
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'us':>8s} {'DRAM MB':>8s} {'GB/s':>6s} {'DRAM%':>5s} {'SM%':>5s} {'occ%':>5s} {'regs':>4s} "
          f"{'grid':>7s}  {'stalls (cycles per issue)':<52s} kernel")
    total_ns = 0.0
    for r in rows:
        ns = r["ns"] or 0.0
        total_ns += ns
        moved = (r["read"] or 0) + (r["write"] or 0)
        rate = moved / ns if ns else 0.0
        stalls = ", ".join(f"{name} {v:.1f}" for v, name in r["stalls"])
        print(f"{ns / 1e3:8.1f} {moved / 1e6:8.1f} {rate:6.0f} {r['dram_pct'] or 0:5.1f} {r['sm_pct'] or 0:5.1f} "
              f"{r['occupancy'] or 0:5.1f} {r['registers'] or 0:4.0f} {r['grid'] or 0:7.0f}  {stalls:<52s} "
              f"{r['kernel'][:60]}")
    print(f"{total_ns / 1e3:8.1f} us in {len(rows)} kernels (counters on: each kernel replayed alone, clocks as set)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--run", action="store_true", help="run the profiled window (under ncu)")
    mode.add_argument("--table", type=Path, help="ncu's --csv --page raw output to tabulate")
    p.add_argument("--case", default="4x4096x16", help="BxTxH (KDA heads of 128)")
    p.add_argument("--out", type=Path, help="--table: the rows as JSON")
    args = p.parse_args()
    if args.run:
        run(args.case)
        return
    text = lzma.open(args.table, "rt").read() if args.table.suffix == ".xz" else args.table.read_text()
    rows = rows_of(text)  # results/ keeps the CSVs xz-compressed
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
