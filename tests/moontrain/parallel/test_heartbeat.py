"""Heartbeats in one process over a HashStore: after a failed collective, diagnose() names the rank whose
counter stopped, and not one that beats or that left on its own. (A frozen rank aborting the job is
tested through `moontrain launch` in tests/moontrain/test_launch_faults.py.)

Reference: which ranks were made to beat, stay silent or leave.
"""

from __future__ import annotations

import torch.distributed as dist

from moontrain.parallel.heartbeat import Heartbeat


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
