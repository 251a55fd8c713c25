"""Batches prepared off the training thread: a background thread runs the token source `prefetch` steps ahead.

The thread reads, tokenizes and packs batch step, step + 1, ... into a bounded queue (pinned host memory
when the model is on a GPU); the training thread takes them in order and copies them to the device
without blocking. With each batch the thread keeps the source's position and metrics right after it, so
`state_dict()` is the position after the last batch the trainer took: a checkpoint written while the
thread is ahead still resumes exactly. The time the training thread waits for a batch is the data wait
(`data/wait_ms` per step in the metrics: ~0 once the queue is full, when the source keeps up).

Errors in the thread (a bad file, a token id outside the vocabulary) are raised in the training thread at
the batch that needed them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from moontrain.data.config import DataConfig
from moontrain.data.source import TokenSource, build_token_source


class BatchLoader:
    def __init__(self, source: TokenSource, *, prefetch: int, device: torch.device) -> None:
        self.source, self.depth, self.device = source, prefetch, device
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_step: int | None = None
        self._state: dict[str, Any] | None = None  # after the last batch taken (None: the source's own)
        self._metrics: dict[str, float] = {}
        self.wait_s, self.batches = 0.0, 0
        self.host_tokens: torch.Tensor | None = None  # batch()'s last ids on the host
        self.eos_id = source.eos_id

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_bT, targets_bT) of this rank for `step`, on the device."""
        t0 = time.perf_counter()
        if self.depth == 0:
            tokens, targets = self.source.batch(step)
            self._metrics = self._source_metrics()
        else:
            if self._thread is None or self._next_step != step:
                self._restart(step)
            assert self._queue is not None
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._thread = None
                raise item
            got_step, tokens, targets, self._state, self._metrics = item
            assert got_step == step, (got_step, step)
            self._next_step = step + 1
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        self.host_tokens = tokens  # the ids of the batch just returned, on the host (pinned on CUDA)
        non_blocking = self.device.type == "cuda"
        return tokens.to(self.device, non_blocking=non_blocking), targets.to(self.device, non_blocking=non_blocking)

    def take_metrics(self) -> dict[str, float]:
        """data/wait_ms (mean per batch since the last call) and the source's counters after the last batch."""
        wait_ms = 1e3 * self.wait_s / max(self.batches, 1)
        self.wait_s, self.batches = 0.0, 0
        return {"data/wait_ms": wait_ms, **self._metrics}

    def state_dict(self) -> dict[str, Any]:
        return self._state if self._state is not None else self.source.state_dict()

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        self.close()
        self.source.load_state_dict(rank_states)
        self._state, self._metrics = None, self._source_metrics()

    def close(self) -> None:
        """Stop the thread (a later batch() starts a new one from the position of the last batch taken)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._state is not None:  # the thread read ahead: rewind the source to what the trainer took
            self.source.load_state_dict(_as_rank_states(self._state, self.source))
            self._state = None

    def _source_metrics(self) -> dict[str, float]:
        metrics = getattr(self.source, "metrics", None)
        return metrics() if metrics is not None else {}

    def _restart(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._next_step = step
        self._thread = threading.Thread(target=self._run, args=(step, self._queue, self._stop),
                                        name="moontrain-data", daemon=True)
        self._thread.start()

    def _run(self, step: int, out: queue.Queue, stop: threading.Event) -> None:
        pin = self.device.type == "cuda"
        try:
            while not stop.is_set():
                tokens, targets = self.source.batch(step)
                if pin:
                    tokens, targets = tokens.pin_memory(), targets.pin_memory()
                item = (step, tokens, targets, self.source.state_dict(), self._source_metrics())
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BaseException as err:  # handed to the training thread, raised at the batch that needed it
            out.put(err)


def _as_rank_states(state: dict[str, Any], source: TokenSource) -> list[dict[str, Any]]:
    """This rank's own state in the form load_state_dict takes (a list over the ranks of the same world size;
    a source reads its own rank's entry, and from any entry only what is the same on every rank)."""
    return [state] * source.world


def build_loader(cfg: DataConfig, *, vocab_size: int, seq_len: int, global_batch: int, rank: int, world_size: int,
                 device: torch.device) -> BatchLoader:
    """The trainer's batches: the token source behind a prefetching thread (data.prefetch batches ahead)."""
    source = build_token_source(cfg, vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch, rank=rank,
                                world_size=world_size)
    return BatchLoader(source, prefetch=cfg.prefetch, device=device)
