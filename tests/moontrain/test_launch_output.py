"""What `moontrain launch` prints when a worker fails (the launcher's run_workers, fake workers instead of the
trainer so each case takes a process start, not a training job):

- every line the ranks write to stderr is forwarded, also after a rank has reported its one-line error (the
  tracebacks of unexpected errors, another rank's lines), and the one-line error comes last, once;
- under torchrun (moontrain.torchrun) the worker's line replaces torchrun's ChildFailedError report, which a
  worker that died without a word still gets.

Reference: the lines the fake workers wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moontrain.cli import run_workers

_WORKER = """
import os, sys, time
print("Traceback (most recent call last):\\n  File 'train.py', line 1\\nOSError: first rank", file=sys.stderr, flush=True)
with open(os.environ["MOONTRAIN_ERROR_FILE"], "x") as fh:
    fh.write("moontrain: rank 0: error: OSError: first rank\\n")
time.sleep(0.5)  # what another rank prints after the error file exists
print("Traceback (most recent call last):\\n  File 'train.py', line 2\\nOSError: second rank", file=sys.stderr, flush=True)
sys.exit(1)
"""


def test_launcher_keeps_rank_tracebacks(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Before, the launcher stopped forwarding stderr once the error file existed: the tracebacks were lost."""
    assert run_workers([sys.executable, "-c", _WORKER]) == 2
    err = capfd.readouterr().err.splitlines()
    assert err == ["Traceback (most recent call last):", "  File 'train.py', line 1", "OSError: first rank",
                   "Traceback (most recent call last):", "  File 'train.py', line 2", "OSError: second rank",
                   "moontrain: rank 0: error: OSError: first rank"], err


def test_torchrun_report_gives_way_to_the_workers_line(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    script = tmp_path / "worker.py"
    torchrun = [sys.executable, "-m", "moontrain.torchrun", "--standalone", "--nproc-per-node", "1", str(script)]
    script.write_text(_WORKER)
    assert run_workers(torchrun) == 2
    err = capfd.readouterr().err
    assert "OSError: first rank" in err and "OSError: second rank" in err and "ChildFailedError" not in err, err
    assert err.endswith("\nmoontrain: rank 0: error: OSError: first rank\n"), err

    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")  # no word from the worker
    assert run_workers(torchrun) == 1
    err = capfd.readouterr().err
    assert "ChildFailedError" in err and "exitcode  : -9" in err, err
