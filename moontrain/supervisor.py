"""Running torchrun from `moontrain launch` so that no rank outlives the launcher and signals reach the ranks.

- SIGTERM / SIGINT / SIGHUP to the launcher: the ranks are asked to stop (SIGUSR1 to each, see
  moontrain.trainer.preempt): they finish the step, save a checkpoint and exit 0, so torchrun and the
  launcher exit 0. A second signal to the launcher aborts: SIGKILL to the ranks and torchrun.
- torchrun ignores SIGTERM / SIGINT / SIGHUP (and is told not to install its own handlers), so a
  scheduler that signals every process of the job reaches each rank once through its own signal and
  once through the launcher's SIGUSR1, which is one request, not two. The launcher repeats SIGUSR1 until
  the ranks exit: a rank still starting up ignores it (inherited SIG_IGN, until its handler is set).
- SIGKILL to the launcher: torchrun gets SIGKILL from the kernel (PR_SET_PDEATHSIG), and so does every
  rank when torchrun dies (the worker sets the same on itself, see die_with_parent). Nothing keeps
  training or writing checkpoints that a relaunch would race.
- When torchrun exits for any reason, ranks it left behind are killed.
- The request is also written to a stop file the ranks check once per step (MOONTRAIN_STOP_FILE, see
  moontrain.trainer.preempt), so it does not depend on the rank's SIGUSR1 handler running. It lives in a
  directory of the launcher's own (mode 0700), so no other user can create it or learn its name.

The ranks are found as torchrun's child processes (/proc, Linux only, like torchrun's multi-process
launch itself).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORWARDED_SIGNAL = signal.SIGUSR1  # what moontrain.trainer.preempt treats as the launcher's stop request
STOP_FILE_ENV = "MOONTRAIN_STOP_FILE"  # moontrain.trainer.preempt.STOP_FILE_ENV (no trainer import here)
_POLL_S = 0.2


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def _torchrun_preexec() -> None:
    # ignored dispositions survive exec: torchrun keeps them, and its ranks keep SIGUSR1 ignored until
    # their handler is installed (its default action would kill a rank that is still importing)
    for sig in (*STOP_SIGNALS, FORWARDED_SIGNAL):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid`: /proc/<pid>/task/*/children, or, where the kernel has no such file
    (CONFIG_PROC_CHILDREN off) or it lists none, a scan of every process's parent pid in /proc/*/stat."""
    out: set[int] = set()
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out.update(int(c) for c in children.read_text().split())
        except (OSError, ValueError):
            continue
    if out:
        return sorted(out)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(out)


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Supervisor:
    """Run `cmd` (torchrun) to completion; see the module docstring for signals."""

    def __init__(self, cmd: list[str], *, env: dict[str, str] | None = None,
                 on_stderr: Callable[[str], None] | None = None, on_stdout: Callable[[str], None] | None = None) -> None:
        self.cmd = cmd
        self.env = env or {}
        self.on_stderr = on_stderr  # called with each line torchrun and the ranks write to stderr
        self.on_stdout = on_stdout  # ... and to stdout
        self.signals_seen = 0
        self.ranks: dict[int, str | None] = {}  # pid -> start time (a pid can be reused once it exits)
        self.proc: subprocess.Popen | None = None
        self._private_dir = tempfile.mkdtemp(prefix="moontrain-")  # mode 0700
        self.stop_file = os.path.join(self._private_dir, "stop")  # its existence is the request

    def run(self) -> int:
        # torchrun's --signals-to-handle defaults to SIGTERM,SIGINT,SIGHUP,SIGQUIT and would overwrite
        # TORCHELASTIC_SIGNALS_TO_HANDLE (torch 2.13): its PET_ variable sets the flag itself
        env = {**os.environ, **self.env, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGQUIT", "PET_SIGNALS_TO_HANDLE": "SIGQUIT",
               STOP_FILE_ENV: self.stop_file}
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        readers: list[threading.Thread] = []
        try:
            self.proc = subprocess.Popen(self.cmd, env=env, preexec_fn=_torchrun_preexec, text=True, bufsize=1,
                                         stderr=subprocess.PIPE if self.on_stderr is not None else None,
                                         stdout=subprocess.PIPE if self.on_stdout is not None else None)
            for stream, callback in ((self.proc.stderr, self.on_stderr), (self.proc.stdout, self.on_stdout)):
                if callback is not None:
                    readers.append(threading.Thread(target=self._read, args=(stream, callback), daemon=True))
                    readers[-1].start()
            while self.proc.poll() is None:
                self._refresh_ranks()
                if self.signals_seen == 1:  # until they exit: a rank still starting up ignores it
                    self._send(self._live_ranks(), FORWARDED_SIGNAL)
                time.sleep(_POLL_S)
            for reader in readers:
                reader.join(timeout=5)
            return self.proc.returncode
        finally:
            self._kill_leftovers()
            shutil.rmtree(self._private_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @staticmethod
    def _read(stream: TextIO, callback: Callable[[str], None]) -> None:
        for line in stream:
            callback(line)

    def _refresh_ranks(self) -> None:
        if self.proc is None:
            return
        for pid in child_pids(self.proc.pid):
            if pid not in self.ranks:
                self.ranks[pid] = _start_time(pid)

    def _live_ranks(self) -> list[int]:
        return [pid for pid, started in self.ranks.items() if started is not None and _start_time(pid) == started]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals_seen += 1
        self._refresh_ranks()
        name = signal.Signals(signum).name
        if self.signals_seen == 1:
            ranks = self._live_ranks()
            who = f"rank processes {', '.join(map(str, ranks))}" if ranks else "the ranks (none started yet)"
            print(f"moontrain: {name}: asking {who} to finish the step, save a checkpoint and exit "
                  "(send it again to abort without saving)", file=sys.stderr, flush=True)
            with open(self.stop_file, "w") as fh:
                fh.write(name)
            self._send(ranks, FORWARDED_SIGNAL)
        else:
            print(f"moontrain: {name} again: aborting (SIGKILL to torchrun and the ranks)", file=sys.stderr,
                  flush=True)
            self._send(self._live_ranks(), signal.SIGKILL)
            if self.proc is not None and self.proc.poll() is None:
                self._send([self.proc.pid], signal.SIGKILL)

    @staticmethod
    def _send(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _kill_leftovers(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._send([self.proc.pid], signal.SIGKILL)
            self.proc.wait()
        left = self._live_ranks()
        if left:
            print(f"moontrain: killing {len(left)} rank process(es) torchrun left behind: {left}", file=sys.stderr,
                  flush=True)
            self._send(left, signal.SIGKILL)
