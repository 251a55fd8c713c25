"""One job per run directory: rank 0 holds `<run_dir>/.lock` for as long as the job trains.

Two jobs on one run directory would interleave checkpoints, prune each other's, resume from each other's
and append to one metrics.jsonl. Rank 0 takes an exclusive flock on the lock file before it reads or writes
anything in the directory and writes its host, pid and start time into it; a second job finds the lock taken
and every one of its ranks stops with the holder named (worker._agree). The kernel drops a flock when its
process exits however it exits, so a killed job leaves no stale lock (the file stays; its content is only
read for the message, never acted on).

flock is advisory and, on a network filesystem, only as good as its locking: NFS v4 forwards it to the
server as a byte-range lock, some filesystems keep it per host. Jobs on one host always exclude each other.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns None, or why not (another job holds it) as the user's error message."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a job that has not written its name"
            os.close(fd)
            return (f"run directory {self.path.parent} is in use by another job ({holder}; lock {self.path}): "
                    "wait for it to finish or stop it, or set another train.run_dir")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None
