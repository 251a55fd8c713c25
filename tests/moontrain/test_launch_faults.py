"""Faults around `moontrain launch` (2 gloo ranks of k3_tiny on CPU, each test a real launch):

- SIGTERM to the launcher: the ranks finish the step, save, and everything exits 0 with a message; no
  process is left and the checkpoint is complete and resumes; while it ran, every socket the job's
  processes listened on was bound to 127.0.0.1 (the launcher's store, gloo);
- SIGINT (Ctrl-C) or SIGTERM (a scheduler) to the whole process group, every rank and torchrun included:
  one checkpoint, exit 0, no traceback;
- SIGKILL mid-run (an OOM kill, a lost node): the newest checkpoint is at most checkpoint.every_minutes
  (plus the step that crossed it and the save) older than the kill;
- SIGKILL to the launcher: torchrun and both ranks are gone within seconds;
- SIGSTOP to rank 1: the job ends within parallel.heartbeat_timeout_s (plus startup slack) and rank 0's
  error names rank 1;
- SIGKILL to rank 1: rank 0's error names rank 1, its traceback is kept, and no line claims a save.

References: the process table (/proc) for leftovers; the checkpoint manifest for completeness; the kernel's
socket tables (/proc/net/tcp, tcp6) for the listening addresses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moontrain.checkpoint.store import is_complete, list_checkpoints
from moontrain.supervisor import child_pids

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")]

REPO = Path(__file__).resolve().parents[2]


class Launch:
    """`moontrain launch recipes/k3_tiny.yaml ...` in the background, its output collected line by line."""

    def __init__(self, run_dir: Path, *overrides: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(  # its own process group, as a shell's job: killpg reaches every process
            [sys.executable, "-m", "moontrain.cli", "launch", "recipes/k3_tiny.yaml", f"train.run_dir={run_dir}",
             "train.log_every=1", "metrics.wandb=false", *overrides],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.seen_pids: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the worker processes under torchrun (recorded for the leftover check)."""
        out = {}
        for torchrun in child_pids(self.proc.pid):
            self.seen_pids.add(torchrun)
            for pid in child_pids(torchrun):
                self.seen_pids.add(pid)
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                rank = [e[5:] for e in env if e.startswith(b"RANK=")]
                if rank:
                    out[int(rank[0])] = pid
        return out

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.output):
            self.ranks()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not printed (rc {self.proc.poll()}):\n{self.output}")
            time.sleep(0.1)
        self.ranks()

    def wait(self, timeout_s: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the launch did not end within {timeout_s} s:\n{self.output}") from None
        self._reader.join(timeout=5)
        return rc

    def listening(self) -> list[str]:
        """The local addresses (the kernel's hex) of every TCP socket a process of the job listens on."""
        inodes = set()
        for pid in self.seen_pids | {self.proc.pid}:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        return [fields[1].rsplit(":", 1)[0] for table in ("/proc/net/tcp", "/proc/net/tcp6")
                for fields in (line.split() for line in Path(table).read_text().splitlines()[1:])
                if fields[3] == "0A" and fields[9] in inodes]

    def alive(self) -> list[int]:
        out = []
        for pid in sorted(self.seen_pids | {self.proc.pid}):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                out.append(pid)
        return out

    def kill_all(self) -> None:
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_gone(launch: Launch, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while launch.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = launch.alive()
    launch.kill_all()
    assert not left, f"processes left behind: {left}\n{launch.output}"


def test_sigterm_to_launcher_saves_and_exits_0(tmp_path: Path) -> None:
    launch = Launch(tmp_path, "train.steps=500")
    try:
        launch.wait_for(r"step +2/500", timeout_s=240)
        listening = launch.listening()
        launch.proc.send_signal(signal.SIGTERM)
        rc = launch.wait(timeout_s=120)
    finally:
        launch.kill_all()
    assert rc == 0, launch.output
    # before: torchrun's stores listened on every interface (::), reachable from other hosts
    assert listening and set(listening) <= {"0100007F", "00000000000000000000000001000000",
                                            "0000000000000000FFFF00000100007F"}, listening
    assert "moontrain: stopped by SIG" in launch.output and "checkpoint saved in" in launch.output, launch.output
    _wait_gone(launch, 5)
    (ckpt,) = list_checkpoints(tmp_path / "checkpoints")
    assert is_complete(ckpt) and 2 <= int(ckpt.name.removeprefix("step_")) < 500
    step = int(ckpt.name.removeprefix("step_"))
    resumed = Launch(tmp_path, f"train.steps={step + 1}", "checkpoint.resume=auto")
    assert resumed.wait(timeout_s=240) == 0, resumed.output
    assert f"resumed from {ckpt} at step {step}" in resumed.output, resumed.output
    assert re.search(rf"step +{step + 1}/{step + 1} ", resumed.output), resumed.output


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "scheduler_sigterm"])
def test_signal_to_the_process_group_saves_once_and_exits_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    launch = Launch(tmp_path, "train.steps=500")
    try:
        launch.wait_for(r"step +2/500", timeout_s=240)
        os.killpg(launch.proc.pid, sig)  # the launcher, torchrun and both ranks, as Ctrl-C or a scheduler does
        rc = launch.wait(timeout_s=120)
        _wait_gone(launch, 5)
    finally:
        launch.kill_all()
    assert rc == 0, launch.output
    assert "Traceback" not in launch.output and "SignalException" not in launch.output, launch.output
    assert launch.output.count("moontrain: stopped by ") == 1, launch.output
    (ckpt,) = list_checkpoints(tmp_path / "checkpoints")
    assert is_complete(ckpt) and 2 <= int(ckpt.name.removeprefix("step_")) < 500


def test_sigkill_mid_run_loses_at_most_the_checkpoint_interval(tmp_path: Path) -> None:
    interval_s = 2.0
    launch = Launch(tmp_path, "train.steps=500", f"checkpoint.every_minutes={interval_s / 60}", "checkpoint.keep_last=1")
    try:
        launch.wait_for(r"step +1/500", timeout_s=240)
        started = time.monotonic()
        while not list_checkpoints(tmp_path / "checkpoints") or time.monotonic() - started < 6:
            assert time.monotonic() - started < 60 and launch.proc.poll() is None, launch.output
            time.sleep(0.2)  # a time-based save at least, and ~6 s of training: a kill between two saves
        os.killpg(launch.proc.pid, signal.SIGKILL)
        killed_at = time.time()
        launch.wait(timeout_s=10)
        _wait_gone(launch, 10)
    finally:
        launch.kill_all()
    (ckpt,) = list_checkpoints(tmp_path / "checkpoints")
    step = int(ckpt.name.removeprefix("step_"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    slowest_step_s = max(r["step_time_s"] for r in records)
    lost_s = killed_at - (ckpt / "manifest.json").stat().st_mtime
    # the save is due once interval_s has passed since the last one; it happens after the step that crossed it
    assert 0 < step and lost_s <= interval_s + 2 * slowest_step_s + 1.0, (lost_s, slowest_step_s, launch.output)


def test_sigkill_to_launcher_leaves_no_process(tmp_path: Path) -> None:
    launch = Launch(tmp_path, "train.steps=500")
    try:
        launch.wait_for(r"step +1/500", timeout_s=240)
        assert len(launch.ranks()) == 2
        launch.proc.send_signal(signal.SIGKILL)
        launch.wait(timeout_s=10)
        _wait_gone(launch, 10)
    finally:
        launch.kill_all()


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_frozen_or_dead_rank_is_named(tmp_path: Path, sig: signal.Signals) -> None:
    timeout_s = 8.0
    launch = Launch(tmp_path, "train.steps=500", f"parallel.heartbeat_timeout_s={timeout_s}", "parallel.timeout_s=300")
    try:
        launch.wait_for(r"step +1/500", timeout_s=240)
        rank1 = launch.ranks()[1]
        os.kill(rank1, sig)
        t0 = time.monotonic()
        rc = launch.wait(timeout_s=timeout_s + 60)
        elapsed = time.monotonic() - t0
        _wait_gone(launch, 10)
    finally:
        launch.kill_all()
    assert rc != 0, launch.output
    if sig == signal.SIGSTOP:
        assert "moontrain: rank 0: aborting: rank 1 (" in launch.output and "sent no heartbeat" in launch.output, \
            launch.output
        assert elapsed < timeout_s + 30, (elapsed, launch.output)
    else:
        assert "moontrain: rank 0: error:" in launch.output and "rank(s) 1 stopped sending heartbeats" in \
            launch.output, launch.output
        # before: the launcher dropped stderr once the error file existed, so the traceback was lost; and the
        # SIGTERM torchrun sent rank 0 after rank 1's death printed a promise to save a checkpoint
        assert "Traceback (most recent call last)" in launch.output, launch.output
        assert "saving a checkpoint" not in launch.output, launch.output
