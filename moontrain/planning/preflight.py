"""Checks a launch can make before any process starts: the data paths and tokenizer, host memory on CPU, and the
GPU's memory against the estimate (in the dry run, and on the first rank before it trains).

Data: every file source (training and evaluation) names existing files of a known format whose text
column (text_field, or the pre-tokenized ids_field) exists, and the tokenizer loads and fits
model.vocab_size. Nothing is read beyond the names, the tokenizer file and each source's column names (the
first jsonl record, a parquet schema, a save_to_disk directory's dataset_info.json). An error names the
source's key (data.path, data.sources.NAME.path, eval.data.path).

Host memory: a CPU run keeps every rank's weights, optimizer state and activations in host memory; the
per-rank estimate of planning.memory times the ranks on this host is compared with MemAvailable.

GPU memory: the per-rank estimate against the GPU's; where it does not fit, the estimate again with each
setting that shrinks it and the recipe lacks (SMALLER, one on top of the other), so a newcomer whose GPU is
smaller than the recipe's sees what to add to the command line (k3_small at EP = 1 on an 80 GB H100: bf16
moments and activation recomputation). The estimate is rough (planning.memory), so a launch only warns.
"""

from __future__ import annotations

import json
from pathlib import Path

from moontrain.config.run_config import RunConfig
from moontrain.data.config import SourceConfig
from moontrain.model.params import count_params
from moontrain.planning.memory import estimate_memory, planned_recompute


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


H200_BYTES = 141e9
# settings that shrink the estimate, tried in this order, each on top of the ones before
SMALLER = (("optim.state_dtype=bfloat16", "optim", "state_dtype", "bfloat16"),
           ("train.activation_checkpointing=true", "train", "activation_checkpointing", True))


def visible_gpu_memory() -> tuple[str, float]:
    """(what, bytes): the visible GPU's memory (this creates a CUDA context), else an H200's as the reference."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"this GPU ({props.name})", float(props.total_memory)
    return "an H200", H200_BYTES


def smaller_settings(cfg: RunConfig, world_size: int, compute_bytes: int, have: float) -> list[str]:
    """The estimate with the SMALLER settings the recipe lacks, added one after another, and whether each fits
    (train.activation_checkpointing=auto counts as recomputation already: it recomputes what it must, resolved
    here against `have` as at launch)."""
    import copy

    out, trial, added = [], copy.deepcopy(cfg), []
    counts = count_params(cfg.model)
    for key, section, field, value in SMALLER:
        current = getattr(getattr(trial, section), field)
        if (current == value and type(current) is type(value)) or (field == "activation_checkpointing" and current == "auto") or (
                section == "optim" and (trial.optim.name != "adamw" or trial.optim.fused)):  # what OptimConfig refuses
            continue
        setattr(getattr(trial, section), field, value)
        added.append(key)
        recomputed = planned_recompute(trial, counts, world_size, compute_bytes, have)
        total = estimate_memory(trial, counts, world_size, compute_bytes, recomputed).total
        out.append(f"with {' '.join(added)}: {total / 2**30:.2f} GiB ({'fits' if total <= have else 'does NOT fit'})")
    return out or ["a smaller train.micro_batch_size, a larger parallel.ep or more GPUs (the estimate is per rank)"]


def gpu_memory_warning(cfg: RunConfig, world_size: int, what: str, have: float) -> str | None:
    """None where the per-rank estimate fits `have` bytes; else one line: the estimate, the GPU's memory and
    smaller_settings."""
    compute_bytes = 4 if cfg.parallel.compute_dtype == "float32" else 2
    counts = count_params(cfg.model)
    recomputed = planned_recompute(cfg, counts, world_size, compute_bytes, have)  # "auto" as the trainer resolves it
    need = estimate_memory(cfg, counts, world_size, compute_bytes, recomputed).total
    if need <= have:
        return None
    return (f"the memory estimate is {need / 2**30:.1f} GiB a rank and {what} has {have / 2**30:.1f} GiB, so this run "
            f"may run out of memory; {'; '.join(smaller_settings(cfg, world_size, compute_bytes, have))} "
            "(the rows: moontrain launch <recipe> --dry-run)")
