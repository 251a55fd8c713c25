"""The one line a run ends with when a training step runs out of GPU memory: the step and the code that asked,
the GPU's memory, the estimate the launch went by, and the settings that would fit by the same estimate.

torch's error (torch.OutOfMemoryError) names the failed allocation and the GPU's free memory, not what to change.
The memory estimate (moontrain.planning.memory) is rough and models the default kernels, and
train.activation_checkpointing=auto takes the fewest layers whose estimate fits 95 % of the GPU, so a run whose
peak exceeds its estimate by more than the 5 % left stops here (measured: k3_small on an 80 GB H100 with
kernels.short_conv=torch, whose compiled PyTorch convolutions keep more than the Triton kernel's, at step 3).
The settings, each with the estimate it gives: recomputing more layers (activations.recompute_order, those
recomputed now being its first ones), enough to free the failed allocation's shortfall (requested minus free,
read from torch's message where it has its usual form) plus MARGIN of the GPU; bf16 AdamW moments; a smaller
micro-batch (gradient accumulation keeps the batch); more GPUs.
"""

from __future__ import annotations

import copy
import re
import traceback
from collections.abc import Collection
from pathlib import Path

from moontrain.config.run_config import RunConfig
from moontrain.model.params import count_params
from moontrain.planning.activations import describe_recompute, recompute_order
from moontrain.planning.memory import estimate_memory

MARGIN = 0.05  # of the GPU's memory, freed beyond the shortfall (the estimate's error on an H100: 0.3-1.4 GiB)
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_ROOT = Path(__file__).resolve().parents[2]


class TrainingOutOfMemory(RuntimeError):
    """A training step ran out of GPU memory; the message is the run's last line (moontrain.trainer.errors)."""


def _size(pattern: str, message: str) -> float | None:
    found = re.search(pattern.replace("SIZE", r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"), message)
    return float(found.group(1)) * _UNITS[found.group(2)] if found else None


def oom_sizes(message: str) -> dict[str, float | None]:
    """Bytes read from torch's CUDA out-of-memory message: requested, total, free, in_use (None where absent)."""
    return {"requested": _size(r"Tried to allocate SIZE", message), "total": _size(r"total capacity of SIZE", message),
            "free": _size(r"of which SIZE is free", message), "in_use": _size(r"has SIZE memory in use", message)}


def raised_at(err: BaseException) -> str | None:
    """path:line of the innermost frame of moontrain or moonep in err's traceback, relative to the repository."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(_ROOT) and path.relative_to(_ROOT).parts[0] in ("moontrain", "moonep"):
            return f"{path.relative_to(_ROOT)}:{frame.lineno}"
    return None


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _with(cfg: RunConfig, section: str, field: str, value: object) -> RunConfig:
    trial = copy.deepcopy(cfg)
    setattr(getattr(trial, section), field, value)
    return trial


def out_of_memory_line(cfg: RunConfig, world_size: int, compute_bytes: int, recomputed: Collection[int], step: int,
                       err: BaseException, gpu_bytes: float | None) -> str:
    """The report of an out-of-memory error raised in step `step` (1-based) of a run recomputing `recomputed`;
    gpu_bytes: the GPU's memory (None: read from torch's message)."""
    counts, L = count_params(cfg.model), cfg.model.num_layers
    sizes = oom_sizes(str(err))
    have = gpu_bytes or sizes["total"]

    def estimate(trial: RunConfig, layers: Collection[int]) -> float:
        return estimate_memory(trial, counts, world_size, compute_bytes, layers).total

    now = estimate(cfg, recomputed)
    fixes = []
    if len(recomputed) < L:
        shortfall = max(0.0, (sizes["requested"] or 0.0) - (sizes["free"] or 0.0))
        goal = now - shortfall - MARGIN * (have or 0.0)
        order = recompute_order(cfg, compute_bytes)
        n = next((n for n in range(len(recomputed) + 1, L) if estimate(cfg, order[:n]) <= goal), L)
        setting = "true" if n == L else str(n)
        fixes.append(f"train.activation_checkpointing={setting} ({_gib(estimate(cfg, order[:n]))})")
    if cfg.optim.name == "adamw" and not cfg.optim.fused and cfg.optim.state_dtype != "bfloat16":
        trial = _with(cfg, "optim", "state_dtype", "bfloat16")
        fixes.append(f"optim.state_dtype=bfloat16 ({_gib(estimate(trial, recomputed))})")
    micro = cfg.train.micro_batch(world_size)
    if micro > 1:
        smaller = max(d for d in range(1, micro) if micro % d == 0)
        trial = _with(cfg, "train", "micro_batch_size", smaller)
        fixes.append(f"train.micro_batch_size={smaller} ({_gib(estimate(trial, recomputed))}; the batch stays "
                     f"{cfg.train.global_batch_size} sequences)")
    fixes.append("or more GPUs: a larger parallel.ep (the estimate is per rank)")
    where = raised_at(err)
    gpu = f"the GPU's {_gib(have)}" if have else "the GPU's memory"
    use = f", {_gib(sizes['in_use'])} in use" if sizes["in_use"] else ""
    asked = f"; it asked for {_gib(sizes['requested'])} more" if sizes["requested"] else ""
    return (f"out of GPU memory in step {step}{f' at {where}' if where else ''} ({gpu}{use}{asked}); the launch's "
            f"memory estimate was {_gib(now)} a rank with {describe_recompute(cfg, recomputed)}, and it is rough. "
            f"Settings that shrink it, with the estimate each gives: {'; '.join(fixes)}. The estimate's rows: "
            "moontrain launch <recipe> --dry-run")
