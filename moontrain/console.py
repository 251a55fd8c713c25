"""The launcher's console, kept: every line `moontrain launch` prints (its own, torchrun's and the ranks'
stdout and stderr) also goes to <train.run_dir>/console.log (console.node<I>.log on node I > 0 of a
multi-node job), appended across relaunches under a header naming the command and the time, so what a
run printed survives the terminal it ran in."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TextIO


class Console:
    def __init__(self, path: Path | None, command: list[str]) -> None:
        """path None: the terminal only (no log file)."""
        self.path = path
        self._lock = threading.Lock()  # the stdout and stderr readers write from two threads
        self._log: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._log = path.open("a", encoding="utf-8")
            self._log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} moontrain {' '.join(command)}\n")
            self._log.flush()

    def out(self, text: str) -> None:
        self._write(sys.stdout, text)

    def err(self, text: str) -> None:
        self._write(sys.stderr, text)

    def _write(self, stream: TextIO, text: str) -> None:
        if text and not text.endswith("\n"):
            text += "\n"
        with self._lock:
            stream.write(text)
            stream.flush()
            if self._log is not None:
                self._log.write(text)
                self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def console_path(run_dir: str, node_rank: int) -> Path:
    return Path(run_dir) / ("console.log" if node_rank == 0 else f"console.node{node_rank}.log")
