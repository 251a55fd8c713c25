"""Preemption: SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0; a second one aborts.

The first SIGTERM or SIGINT (what slurm and other schedulers send, or Ctrl-C) only sets a flag. The
trainer reduces it over the ranks with the step's verdict (moontrain.trainer.guard), so all ranks stop
after the same step, save and return from fit(); the worker then exits 0 with a message. The handler
restores the default action of both signals, so a second one kills the process at once (even while
it is blocked in a collective, where a Python handler would not run).

SIGUSR1 is the launcher's forwarded request (moontrain.supervisor): a stop request like the first
SIGTERM, but it never aborts, because a scheduler that signals every process delivers its own SIGTERM
to the rank as well and the two are one request.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORWARDED_SIGNAL = signal.SIGUSR1


class PreemptionHandler:
    """Installs the handlers on construction (main thread only); `requested` says whether to stop."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.requested = False
        self.signal_name: str | None = None
        self._previous = {sig: signal.signal(sig, self._on_stop) for sig in (*STOP_SIGNALS, FORWARDED_SIGNAL)}

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if signum != FORWARDED_SIGNAL:  # a second SIGTERM / SIGINT takes the default action: abort
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
        if not self.requested:
            self.requested = True
            self.signal_name = signal.Signals(signum).name
            print(f"moontrain: rank {self.rank}: {self.signal_name} received: finishing the current step, then "
                  "saving a checkpoint and exiting (send it again to abort without saving)",
                  file=sys.stderr, flush=True)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
