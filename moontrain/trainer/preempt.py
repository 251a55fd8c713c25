"""Preemption: SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0; a second one aborts.

The first SIGTERM or SIGINT (what slurm and other schedulers send, or Ctrl-C) only sets a flag. The
trainer reduces it over the ranks with the step's verdict (moontrain.trainer.guard), so all ranks stop
after the same step, save and return from fit(); the worker then exits 0 with a message. The handler
restores the default action of both signals, so a second one kills the process at once (even while
it is blocked in a collective, where a Python handler would not run).

The line printed when the signal arrives says only that it arrived: whether a checkpoint follows is known
after the step (the trainer says so when it saves, the worker when it exits). A SIGTERM is also what
torchrun sends every rank when another one has failed; that job ends with the failure's error, not a save.

SIGUSR1 is the launcher's forwarded request (moontrain.supervisor): a stop request like the first
SIGTERM, but it never aborts, because a scheduler that signals every process delivers its own SIGTERM
to the rank as well and the two are one request. The launcher also writes its request to the file named
by MOONTRAIN_STOP_FILE (in its private directory), which `requested` checks once per step and honours only
when this user owns it (a regular file, not a link), because SIGUSR1 alone is not reliable on
the GPU: when Triton compiles a kernel in the process, LLVM installs its own signal handlers, SIGUSR1
among its "info" signals, and its SIGUSR1 handler does not chain to the one installed before it (SIGTERM
and SIGINT it does pass on, restoring the earlier handlers and raising again). A rank that compiled
kernels in its first step then never sees the launcher's SIGUSR1.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORWARDED_SIGNAL = signal.SIGUSR1
STOP_FILE_ENV = "MOONTRAIN_STOP_FILE"


class PreemptionHandler:
    """Installs the handlers on construction (main thread only); `requested` says whether to stop."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._requested = False
        self.signal_name: str | None = None
        self._stop_file = os.environ.get(STOP_FILE_ENV) or None
        self._refused = False  # a stop file that is not ours was named already
        self._previous = {sig: signal.signal(sig, self._on_stop) for sig in (*STOP_SIGNALS, FORWARDED_SIGNAL)}

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for: a signal, or the launcher's stop file (one stat per call)."""
        if not self._requested and self._stop_file is not None and self._stop_file_is_ours():
            try:
                name = Path(self._stop_file).read_text().strip()
            except OSError:
                name = ""
            self._request(f"{name or 'a stop request'} to the launcher")
        return self._requested

    def _stop_file_is_ours(self) -> bool:
        assert self._stop_file is not None
        try:
            st = os.lstat(self._stop_file)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            return True
        if not self._refused:  # said once, not at every step
            self._refused = True
            print(f"moontrain: rank {self.rank}: ignoring the stop file {self._stop_file}: not a regular file of uid "
                  f"{os.getuid()} (uid {st.st_uid}, mode {st.st_mode:o}); only the launcher asks to stop through it",
                  file=sys.stderr, flush=True)
        return False

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if signum != FORWARDED_SIGNAL:  # a second SIGTERM / SIGINT takes the default action: abort
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
        self._request(signal.Signals(signum).name)

    def _request(self, name: str) -> None:
        if not self._requested:
            self._requested = True
            self.signal_name = name
            print(f"moontrain: rank {self.rank}: {name} received: a stop request (send it again to abort at once)",
                  file=sys.stderr, flush=True)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
