"""Run a function on N gloo CPU processes (torch.multiprocessing) and collect rank 0's result."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(*args) on every rank of a fresh gloo group; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
