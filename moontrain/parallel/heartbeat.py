"""Heartbeats through the rendezvous store, so that a dead or frozen rank is named by every survivor.

Every rank runs one daemon thread that, each `interval_s`, adds 1 to its counter `moontrain/hb/<rank>`
in the store of the default process group (the torchrun agent's TCPStore). Rank 0 watches every
counter; the other ranks watch rank 0's. A counter that has not moved for `timeout_s` (measured on the
watcher's own clock, so hosts need no synchronised clocks) names a silent rank: the watcher publishes
the verdict under `moontrain/hb/verdict`, every rank that reads it prints the same line naming the
rank, and each exits with EXIT_CODE (the main thread may be blocked in a collective that would
otherwise wait for the process-group timeout). A silent rank on the watcher's own host is killed
(SIGKILL), so torchrun does not wait out its shutdown grace on a stopped process.

What the watcher kills is never read from the store (anyone who reaches a TCPStore can write any key):
it is the sibling process with that RANK under the same torchrun agent, found in the kernel's process
table (a child of this process's parent whose environment has RANK=r and this job's TORCHELASTIC_RUN_ID),
held by a pidfd while it is checked so that the pid cannot be reused in between. A rank on another host
is not killed (its own agent tears it down). The store only carries counters, the verdict text and each
rank's host name for the message: a stranger writing keys can abort the job, not aim its kill.

The thread needs the GIL only briefly, and collectives release it, so a rank waiting in a collective
still beats; a SIGSTOPped, dead or deadlocked-with-the-GIL-held process does not. Store traffic is
O(world) per interval: rank 0 reads every counter in one multi_get, the others read two keys.

After an error in a collective (a killed peer resets the connection within seconds, long before
`timeout_s`) `diagnose()` waits a few intervals and names the ranks whose counters stopped and that
did not leave on their own (`moontrain/hb/left/<rank>`: set by a rank that finished or saw an error itself).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from moontrain.supervisor import child_pids

EXIT_CODE = 3
_PREFIX = "moontrain/hb/"
_HOST_NAME = re.compile(r"[A-Za-z0-9._-]{1,253}")  # what the message prints of a host name read from the store


class Heartbeat:
    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float,
                 report: Callable[[str], None] | None = None, interval_s: float | None = None) -> None:
        """report: prints the abort line (default: to stderr as `moontrain: rank R: aborting: ...`);
        interval_s: between beats (default timeout_s / 10, within [0.2, 5] s)."""
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.report = report or (lambda line: print(f"moontrain: rank {rank}: {line}", file=sys.stderr, flush=True))
        self.interval_s = interval_s or max(0.2, min(5.0, timeout_s / 10))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store.set(f"{_PREFIX}host/{rank}", socket.gethostname())  # for the message only
        store.add(self._key(rank), 1)

    @staticmethod
    def _key(rank: int) -> str:
        return f"{_PREFIX}{rank}"

    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, name="moontrain-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank leaves (finished, or failed and reported it): peers no longer expect its beats."""
        self.mark_left()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    def _watched(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]

    def _counters(self, ranks: list[int]) -> dict[int, int]:
        present = [r for r in ranks if self.store.check([self._key(r)])]  # a get would block on a missing key
        values = self.store.multi_get([self._key(r) for r in present]) if present else []
        return {r: int(v) for r, v in zip(present, values, strict=True)}

    def _run(self) -> None:
        watched = self._watched()
        now = time.monotonic()
        seen: dict[int, tuple[int, float]] = {r: (-1, now) for r in watched}
        try:
            while not self._stop.wait(self.interval_s):
                self.store.add(self._key(self.rank), 1)
                now = time.monotonic()
                for r, count in self._counters(watched).items():
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                if self.rank != 0 and self.store.check([f"{_PREFIX}verdict"]):
                    self._abort(self.store.get(f"{_PREFIX}verdict").decode())
                silent = [r for r in watched if now - seen[r][1] > self.timeout_s and not self._left(r)]
                if silent:
                    killed = {r: pid for r in silent if (pid := kill_local_rank(r)) is not None}
                    verdict = self._describe(silent, now - min(seen[r][1] for r in silent), killed)
                    if self.rank == 0:
                        self.store.set(f"{_PREFIX}verdict", verdict)
                    self._abort(verdict)
        except Exception as err:  # the store went away (job ending): nothing left to watch
            if not self._stop.is_set():
                print(f"moontrain: rank {self.rank}: heartbeat stopped: {err}", file=sys.stderr, flush=True)

    def _left(self, rank: int) -> bool:
        return self.store.check([f"{_PREFIX}left/{rank}"])

    def _describe(self, ranks: list[int], silent_s: float, killed: dict[int, int]) -> str:
        where = []
        for r in ranks:
            key = f"{_PREFIX}host/{r}"
            host = self.store.get(key).decode(errors="replace") if self.store.check([key]) else ""
            where.append(f"rank {r} (host {host if _HOST_NAME.fullmatch(host) else 'unknown'}"
                         + (f", pid {killed[r]} killed" if r in killed else "") + ")")
        return (f"{', '.join(where)} sent no heartbeat for {silent_s:.0f} s (frozen, stopped or dead; "
                f"parallel.heartbeat_timeout_s={self.timeout_s:g})")

    def _abort(self, verdict: str) -> None:
        self.report(f"aborting: {verdict}")
        os._exit(EXIT_CODE)

    def mark_left(self) -> None:
        """Mark this rank as leaving on its own (done, or it saw an error itself): not a culprit."""
        try:
            self.store.set(f"{_PREFIX}left/{self.rank}", "1")
        except Exception:  # best effort: the store may be gone
            pass

    def diagnose(self) -> str | None:
        """After a failed collective: the ranks whose heartbeats stopped (None if every rank still beats)."""
        self.mark_left()
        ranks = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = self._counters(ranks)
            time.sleep(3 * self.interval_s)
            after = self._counters(ranks)
            stopped = [r for r in ranks if before.get(r) == after.get(r) and not self._left(r)]
        except Exception:  # the store is gone too: nothing to say
            return None
        if not stopped:
            return None
        return f"rank(s) {', '.join(map(str, stopped))} stopped sending heartbeats (dead or frozen)"


def kill_local_rank(rank: int) -> int | None:
    """SIGKILL rank `rank` of this job if it runs on this host under this process's torchrun agent (see the
    module docstring); returns its pid, or None when there is no such process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or not sys.platform.startswith("linux"):
        return None
    want = {f"RANK={rank}".encode(), f"TORCHELASTIC_RUN_ID={run_id}".encode()}
    for pid in child_pids(os.getppid()):
        if pid == os.getpid():
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
        try:
            if want <= set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                return pid
        except OSError:
            continue
        finally:
            os.close(pidfd)
    return None
