"""Checks a launch can make before any process starts: the data paths and tokenizer, and host memory on CPU.

Data: every file source (training and evaluation) names existing files of a known format, and the
tokenizer loads and fits model.vocab_size. Nothing is read beyond the names and the tokenizer file.

Host memory: a CPU run keeps every rank's weights, optimizer state and activations in host memory; the
per-rank estimate of planning.memory times the ranks on this host is compared with MemAvailable.
"""

from __future__ import annotations

from pathlib import Path

from moontrain.config.run_config import RunConfig
from moontrain.planning.memory import estimate_memory
from moontrain.planning.params import count_params


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
    sources = dict(data.file_sources()) if data.source == "dataset" else {}
    mixture = len(sources) > 1
    if cfg.eval.data is not None:
        sources["eval"] = cfg.eval.data
    for name, src in sources.items():
        fmt = _format(src)
        files = [src.path] if fmt == "saved" else _data_files(src.path)
        size = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
        lines.append(f"data {name}: {src.path} ({fmt}, {len(files)} file(s), {size / 2**20:.1f} MiB"
                     + (f", weight {src.weight:g}" if mixture and name != "eval" else "") + ")")
    return lines


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
