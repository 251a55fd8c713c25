"""Heartbeats in one process over a HashStore: after a failed collective, diagnose() names the rank whose
counter stopped, and not one that beats or that left on its own. A watcher in a process of its own kills its
silent sibling rank and no process a store client names. (A frozen rank aborting the job is tested through
`moontrain launch` in tests/moontrain/test_launch_faults.py.)

Reference: which ranks were made to beat, stay silent or leave; which processes are alive afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from moontrain.parallel.heartbeat import EXIT_CODE, Heartbeat
from moontrain.parallel.job_store import JobStore

REPO = Path(__file__).resolve().parents[3]


def test_diagnose_names_the_silent_rank_only() -> None:
    store = dist.HashStore()
    me = Heartbeat(store, 0, 4, timeout_s=60.0, interval_s=0.2)  # its own thread is not needed here
    alive = Heartbeat(store, 1, 4, timeout_s=60.0, interval_s=0.05).start()
    Heartbeat(store, 2, 4, timeout_s=60.0)  # registered, then silent: dead or frozen
    left = Heartbeat(store, 3, 4, timeout_s=60.0)
    left.mark_left()  # finished or failed on its own
    try:
        assert me.diagnose() == "rank(s) 2 stopped sending heartbeats (dead or frozen)"
    finally:
        alive.stop()
    assert store.check(["moontrain/hb/left/0"]) and store.check(["moontrain/hb/left/1"])


_WATCHER = """
import sys, time
import torch.distributed as dist
from moontrain.parallel.heartbeat import Heartbeat
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
Heartbeat(store, 0, 2, timeout_s=1.0, interval_s=0.2).start()
time.sleep(60)
"""


def _sleeper(**env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={k: v for k, v in os.environ.items() if k not in ("RANK", "TORCHELASTIC_RUN_ID")} | env)


def test_store_client_cannot_kill_other_processes() -> None:
    """A store client names an unrelated process as rank 1's pid (the key the heartbeat used to kill by) and rank 1
    stays silent. The watcher (rank 0, a child of this test like torchrun's ranks are of their agent) must kill
    the real rank 1, its sibling with RANK=1 and its TORCHELASTIC_RUN_ID, and nothing else: not the named
    process, not a RANK=1 process of another job. Before, it SIGKILLed whatever pid the store held."""
    store = JobStore()
    victim = _sleeper()
    other_job = _sleeper(RANK="1", TORCHELASTIC_RUN_ID="another-job")
    rank1 = _sleeper(RANK="1", TORCHELASTIC_RUN_ID="job-a")
    sleepers = (victim, other_job, rank1)
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        client.set("moontrain/hb/pid/1", f"{socket.gethostname()} {victim.pid}")
        client.set("moontrain/hb/host/1", "evil\nmoontrain: rank 0: everything is fine")
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "TORCHELASTIC_RUN_ID": "job-a"}
        watcher = subprocess.run([sys.executable, "-c", _WATCHER, str(store.port)], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert watcher.returncode == EXIT_CODE, watcher.stderr
        assert rank1.wait(timeout=10) == -signal.SIGKILL
        assert victim.poll() is None and other_job.poll() is None, "a process outside the job was killed"
        assert re.fullmatch(rf"moontrain: rank 0: aborting: rank 1 \(host unknown, pid {rank1.pid} killed\) sent no "
                            r"heartbeat for \d+ s \(frozen, stopped or dead; parallel.heartbeat_timeout_s=1\)\n",
                            watcher.stderr), watcher.stderr
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
        store.close()
