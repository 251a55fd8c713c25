"""Read the logged history back from wandb's own offline run file (`run-<id>.wandb`), without a server.

The file is wandb's record log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks
of chunks, each with a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle,
4 last); a block tail shorter than a chunk header is zero padding. The chunks of one record concatenate
to a serialized `wandb_internal_pb2.Record`; history records hold one logged step's items.
Used by the tests and for checking an offline run before `wandb sync`:

    python -m moontrain.metrics.wandb_offline runs/k3_small          # step, loss, eval loss, maxvio per layer
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a wandb run file (no :W&B header)")
    pos, out, parts = _HEADER, [], []
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:  # zero padding to the block end
            pos += room
            continue
        if pos + _HEADER + length > len(data):  # a file cut short (a killed job): the records before it stand
            break
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            parts = [chunk]
        elif kind == _MIDDLE:
            parts.append(chunk)
        elif kind == _LAST:
            out.append(b"".join([*parts, chunk]))
            parts = []
    return out


def read_history(run_file: str | Path) -> list[dict[str, object]]:
    """Every history row (one per logged step) of an offline run file, values decoded from JSON."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in _records(Path(run_file).read_bytes()):
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except Exception:  # protobuf's DecodeError: a damaged record of a killed job's file
            continue
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_files(run_dir: str | Path) -> list[Path]:
    """The offline run files under <run_dir>/wandb, oldest first (a resumed run adds one per resume)."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))


def main(argv: list[str]) -> int:
    """Print every logged step of a run directory's offline wandb runs: loss, eval loss, data wait, and the
    expert-level maxvio of every MoE layer."""
    if len(argv) != 1:
        print("usage: python -m moontrain.metrics.wandb_offline RUN_DIR", file=sys.stderr)
        return 2
    rows = {}
    for f in run_files(argv[0]):  # a resumed run adds a file; a step logged twice keeps the later value
        for row in read_history(f):
            rows[row["_step"]] = row
    if not rows:
        print(f"no offline wandb run under {argv[0]}/wandb", file=sys.stderr)
        return 1
    layers = sorted({k for row in rows.values() for k in row if k.startswith("moe/expert_maxvio/layer")},
                    key=lambda k: int(k.rsplit("layer", 1)[1]))
    print(" ".join(["step", "loss", "eval_loss", "wait_ms", *[k.rsplit("/", 1)[1] for k in layers]]))
    for step in sorted(rows):
        row = rows[step]
        cells = [row.get(k) for k in ("loss", "eval/loss", "data/wait_ms", *layers)]
        print(" ".join([str(step), *("-" if v is None else f"{v:.4f}" for v in cells)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
