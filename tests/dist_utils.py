"""Run a function on R spawned CPU ranks joined by a gloo process group, for multi-process tests.

    results = run_ranks(fn, world_size, *args, timeout_s=120)   # fn(rank, world_size, *args)

Each rank is a fresh process (start method spawn, OMP_NUM_THREADS=1 so R ranks do not
oversubscribe the 2 CI cores) in a gloo group on localhost (its rendezvous below). `fn` must be
picklable (a module-level function) and so must its return value. Results come back as pickled
bytes through a multiprocessing queue: the child pickles with plain `pickle`, so tensors travel by
value instead of through torch's shared-memory handles, which would die with the child.

Failures: if any rank raises, the parent raises AssertionError with every failing rank's full
traceback; the other ranks are given `error_grace_s` to finish (so a peer's own timeout error is
reported too) and are then killed. If the deadline passes with ranks still running, they are
killed and the parent raises TimeoutError naming them. A rank that dies without a word (killed,
segfault) is reported with its exit code.

The ranks meet at a TCPStore that the parent serves on a port the OS gives it (port 0) and holds
until the ranks are done, so no other test (pytest-xdist runs two at once) can take that port between
its choice and its use. free_port() is for tests that hand a port to another program (torchrun's
rendezvous): it binds port 0 and closes the socket, so another process could take the port before that
program binds it, which would show up as an init error, not as a wrong result.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]

_POLL_S = 0.05


def free_port() -> int:
    """A localhost TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result_queue: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the parent's
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        # every rank's gloo connections made before any rank runs fn: a rank whose fn returns at once could
        # otherwise leave and exit while another's side was still being made, which then failed in
        # init_process_group ("Connection closed by peer"; seen on a loaded 2-core machine)
        dist.barrier()
        try:
            payload = pickle.dumps(fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
        result_queue.put(("ok", rank, payload))
    except BaseException:
        result_queue.put(("error", rank, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    error_grace_s: float = 30.0,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return the results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    name = getattr(fn, "__qualname__", repr(fn))
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    # the ranks' rendezvous, served here on a port the OS picks, held until the ranks are joined below
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    port = store.port

    # Children inherit the environment at start; OMP reads it when torch is imported there.
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, timeout_s, fn, args, result_queue),
                name=f"{name}-rank{rank}",
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
    finally:
        if saved_omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved_omp

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s

    def record(status: str, rank: int, payload: Any) -> None:
        nonlocal deadline
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + error_grace_s)

    try:
        while len(results) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                record(*result_queue.get(timeout=_POLL_S))
                continue
            except queue.Empty:
                pass
            dead = [
                rank
                for rank, proc in enumerate(procs)
                if proc.exitcode is not None and rank not in results and rank not in errors
            ]
            if not dead:
                continue
            # A rank that reported flushed its message before exiting: read the pipe once more.
            try:
                record(*result_queue.get(timeout=1.0))
            except queue.Empty:
                for rank in dead:
                    record("error", rank, f"process exited with code {procs[rank].exitcode} without a report")
    finally:
        alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in alive:
            if rank in results or rank in errors:
                procs[rank].join(timeout=5.0)  # it reported and is exiting
        still_alive = [rank for rank in alive if procs[rank].is_alive()]
        for rank in still_alive:
            procs[rank].kill()
        for proc in procs:
            proc.join()
        result_queue.close()
        del store

    unfinished = [rank for rank in range(world_size) if rank not in results and rank not in errors]
    if errors:
        report = "\n".join(
            f"----- rank {rank} of {world_size} raised -----\n{errors[rank]}" for rank in sorted(errors)
        )
        if unfinished:
            report += f"\nranks {unfinished} had not finished and were killed"
        raise AssertionError(f"run_ranks({name}): {len(errors)} of {world_size} ranks failed\n{report}")
    if unfinished:
        raise TimeoutError(
            f"run_ranks({name}): ranks {unfinished} of {world_size} still alive after "
            f"timeout_s={timeout_s:g} s; killed them"
        )
    return [results[rank] for rank in range(world_size)]
