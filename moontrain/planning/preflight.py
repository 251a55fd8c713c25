"""Checks a launch can make before any process starts: the data paths and tokenizer, and host memory on CPU.

Data: every file source (training and evaluation) names existing files of a known format whose text
column (text_field, or the pre-tokenized ids_field) exists, and the tokenizer loads and fits
model.vocab_size. Nothing is read beyond the names, the tokenizer file and each source's column names (the
first jsonl record, a parquet schema, a save_to_disk directory's dataset_info.json). An error names the
source's key (data.path, data.sources.NAME.path, eval.data.path).

Host memory: a CPU run keeps every rank's weights, optimizer state and activations in host memory; the
per-rank estimate of planning.memory times the ranks on this host is compared with MemAvailable.
"""

from __future__ import annotations

import json
from pathlib import Path

from moontrain.config.run_config import RunConfig
from moontrain.data.config import SourceConfig
from moontrain.model.params import count_params
from moontrain.planning.memory import estimate_memory


def check_data(cfg: RunConfig) -> list[str]:
    """Raises ValueError naming the first bad path or tokenizer; returns one line per source checked."""
    from moontrain.data.documents import _data_files, _format
    from moontrain.data.tokenizer import check_vocab, load_tokenizer

    data, lines = cfg.data, []
    if data.source != "dataset" and cfg.eval.data is None:
        return ["data: synthetic Markov tokens (data.source=markov; data.source=dataset data.path=... for files)"]
    tokenizer = load_tokenizer(data.tokenizer, eos_id=data.eos_id)
    check_vocab(data.tokenizer, tokenizer.vocab_size, cfg.model.vocab_size)
    lines.append(f"tokenizer: {data.tokenizer} ({tokenizer.vocab_size} ids, eos {tokenizer.eos_id}; "
                 f"model.vocab_size {cfg.model.vocab_size})")
    sources = {("data" if name == "data" and not data.sources else f"data.sources.{name}"): src
               for name, src in (data.file_sources().items() if data.source == "dataset" else ())}
    mixture = len(sources) > 1
    if cfg.eval.data is not None:
        sources["eval.data"] = cfg.eval.data
    for key, src in sources.items():
        try:
            fmt = _format(src)
            files = [src.path] if fmt == "saved" else _data_files(src.path)
            _check_columns(src, fmt)
        except ValueError as err:
            raise ValueError(f"{key}.path={src.path!r}: {err}") from None
        paths = [p for f in files for p in ([Path(f)] if Path(f).is_file() else Path(f).rglob("*"))]
        size = sum(p.stat().st_size for p in paths if p.is_file())
        lines.append(f"{key}: {src.path} ({fmt}, {len(files)} file(s), {size / 2**20:.1f} MiB"
                     + (f", weight {src.weight:g}" if mixture and key != "eval.data" else "") + ")")
    return lines


def _check_columns(src: SourceConfig, fmt: str) -> None:
    """The text (or ids) column exists: the names come from the first jsonl record, the parquet schema or a
    save_to_disk directory's dataset_info.json (raises ValueError naming text_field and the columns there
    are). A file that cannot tell (empty, not JSON) is left to the worker's reader, which names the problem."""
    from moontrain.data.documents import _data_files, _field

    first = _data_files(src.path)[0] if fmt in ("jsonl", "parquet") else None
    if fmt == "jsonl":
        with open(first, encoding="utf-8") as fh:
            line = next((line for line in fh if line.strip()), None)
        try:
            record = json.loads(line) if line is not None else None
        except json.JSONDecodeError:
            record = None
        columns = list(record) if isinstance(record, dict) else None
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        columns = pq.ParquetFile(first).schema_arrow.names
    elif fmt == "saved" and (Path(src.path) / "dataset_info.json").is_file():
        columns = list(json.loads((Path(src.path) / "dataset_info.json").read_text()).get("features") or {})
    else:
        columns = None
    if columns:
        _field(src, fmt, columns)


def available_host_bytes() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_line(cfg: RunConfig, world_size: int, local_ranks: int) -> tuple[str, bool]:
    """(the report line, whether it fits) for a CPU run of `local_ranks` ranks on this host."""
    compute_bytes = 4 if cfg.parallel.compute_dtype in ("auto", "float32") else 2
    need = estimate_memory(cfg, count_params(cfg.model), world_size, compute_bytes).total * local_ranks
    have = available_host_bytes()
    if have is None:
        return f"host memory: need ~{need / 2**30:.1f} GiB for {local_ranks} rank(s); available unknown", True
    fits = need <= 0.9 * have
    return (f"host memory: need ~{need / 2**30:.2f} GiB for {local_ranks} CPU rank(s), {have / 2**30:.1f} GiB "
            f"available: {'fits' if fits else 'does NOT fit'}"), fits
