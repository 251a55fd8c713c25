"""Faults: a peer that raises or dies mid-call makes the other ranks fail with MoonEPTimeoutError
naming the call, in bounded time, and leaves no shared memory behind.

Two spawns (each costs one process start plus one 5 s timeout):
- R = 3: rank 1 fails inside dispatch after the ranks agreed its input is valid (an injected error
  before the histogram exchange; invalid input itself makes every rank raise at once, see
  test_bad_input_one_rank.py) while ranks 0 and 2 go on; both must time out in "dispatch:histograms". Rank 1 stays
  alive until its peers are done, so they see a real timeout rather than a closed connection.
- R = 2: rank 1 writes its rows and then dies with os._exit before the "dispatch:rows" barrier;
  rank 0 must fail there. The parent's run_ranks reports rank 1's exit code as an error, so
  rank 0 reports its outcome through a file.

Residue: the parent compares /dev/shm before and after (Python multiprocessing's own named
semaphores excepted, see _new_dev_shm); each surviving rank checks that after destroy() it maps no
moonep memory and holds no moonep descriptor (the CPU heap uses memfds, which have no /dev/shm
name, so the per-process check is the one that can see a leak).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch

from moonep import Buffer, BufferConfig, BufferOptions, MoonEPTimeoutError
from tests.dist_utils import run_ranks

TIMEOUT_S = 5.0
S, H, K = 8, 32, 2


def _routing(rank: int, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    w = torch.rand(S, K, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(torch.int32)
    return x, w, topk


def _moonep_residue() -> list[str]:
    """moonep heap mappings and descriptors this process still holds."""
    maps = [line.strip() for line in Path("/proc/self/maps").read_text().splitlines() if "moonep" in line]
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "moonep" in target:
            fds.append(f"fd {fd} -> {target}")
    return maps + fds


def _failing_call(buf: Buffer, fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        outcome = {"type": None, "msg": ""}
    except Exception as exc:  # reported to the parent, which checks the type
        outcome = {"type": type(exc).__name__, "msg": str(exc),
                   "is_timeout_error": isinstance(exc, MoonEPTimeoutError)}
    outcome["elapsed_s"] = time.monotonic() - start
    with_heap = _moonep_residue()
    buf.destroy()
    buf.destroy()  # idempotent, also after a failed call
    outcome["held_before_destroy"] = len(with_heap)
    outcome["residue_after_destroy"] = _moonep_residue()
    return outcome


def _wait_for(paths: list[Path], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------------------------- rank raises
def _raising_peer(rank: int, world: int, tmp: str) -> dict:
    E = 2 * world
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4, options=BufferOptions(timeout_s=TIMEOUT_S)))
    x, w, topk = _routing(rank, E)
    first = buf.dispatch(x, w, topk)  # a healthy call first: the group works before the fault
    healthy = first.plan.num_tokens == S
    done = Path(tmp) / f"done{rank}"
    if rank == 1:
        def crash(*args: object) -> None:
            raise RuntimeError("injected fault before the histogram exchange")

        buf._plan_collective = crash  # type: ignore[method-assign]
        outcome = _failing_call(buf, lambda: buf.dispatch(x, w, topk))
        done.touch()
        # stay alive (no barrier) until the peers have timed out, so they see a timeout, not a close
        outcome["peers_done"] = _wait_for([Path(tmp) / f"done{r}" for r in range(world) if r != 1], 60)
    else:
        outcome = _failing_call(buf, lambda: buf.dispatch(x, w, topk))
        done.touch()
    outcome["healthy_first_call"] = healthy
    return outcome


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _new_dev_shm(before: set[str]) -> list[str]:
    """New /dev/shm entries, except Python multiprocessing's named semaphores (sem.mp-*): those
    belong to run_ranks' result queue (unlinked by its finalizer or the resource tracker) and to
    any other test run on this machine. moonep's CPU heap uses memfds and creates no name at all,
    so anything else that appears is residue."""
    gc.collect()  # finalizers of this process's own queues unlink their semaphores
    deadline = time.monotonic() + 3.0
    while True:
        residue = sorted(n for n in _dev_shm() - before if not n.startswith("sem.mp-"))
        if not residue or time.monotonic() > deadline:
            return residue
        time.sleep(0.2)


def test_rank_raising_mid_call_times_out_its_peers(tmp_path: Path) -> None:
    before = _dev_shm()
    start = time.monotonic()
    out = run_ranks(_raising_peer, 3, str(tmp_path), timeout_s=120, error_grace_s=30)
    elapsed = time.monotonic() - start
    assert out[1]["type"] == "RuntimeError" and "injected fault" in out[1]["msg"], out[1]
    assert out[1]["peers_done"], "rank 1's peers never finished their failing call"
    for rank in (0, 2):
        o = out[rank]
        assert o["healthy_first_call"]
        assert o["type"] == "MoonEPTimeoutError" and o["is_timeout_error"], f"rank {rank}: {o}"
        assert "'dispatch:histograms'" in o["msg"], f"rank {rank}: the message must name the call: {o['msg']}"
        assert f"rank {rank}" in o["msg"] and f"{TIMEOUT_S}" in o["msg"], o["msg"]
        assert TIMEOUT_S * 0.8 <= o["elapsed_s"] <= TIMEOUT_S * 4, f"rank {rank} failed after {o['elapsed_s']:.1f} s"
    assert "Ranks 1 failed" in out[0]["msg"], f"rank 0 (gloo's monitor) should name the missing rank: {out[0]['msg']}"
    for rank, o in enumerate(out):
        assert o["held_before_destroy"] > 0, "the residue probe saw no heap mapping before destroy"
        assert o["residue_after_destroy"] == [], f"rank {rank} still holds {o['residue_after_destroy']}"
    assert elapsed < 90, f"the faulty run took {elapsed:.1f} s"
    assert _new_dev_shm(before) == []


# ---------------------------------------------------------------------------------- rank dies
def _dying_peer(rank: int, world: int, tmp: str) -> dict:
    E = 2 * world
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4, options=BufferOptions(timeout_s=TIMEOUT_S)))
    x, w, topk = _routing(rank, E)
    buf.dispatch(x, w, topk)
    if rank == 1:
        barrier = buf.barrier

        def die_before_rows(call: str) -> None:
            if call == "dispatch:rows":  # rows are already written into the peer: die mid-protocol
                os._exit(3)
            barrier(call)

        buf.barrier = die_before_rows  # type: ignore[method-assign]
        buf.dispatch(x, w, topk)
        return {"survived": True}
    outcome = _failing_call(buf, lambda: buf.dispatch(x, w, topk))
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(outcome))
    return outcome


def test_rank_killed_mid_call_times_out_its_peer(tmp_path: Path) -> None:
    before = _dev_shm()
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"1 of 2 ranks failed[\s\S]*rank 1 of 2[\s\S]*exited with code 3"):
        run_ranks(_dying_peer, 2, str(tmp_path), timeout_s=120, error_grace_s=30)
    elapsed = time.monotonic() - start
    report = tmp_path / "rank0.json"
    assert report.exists(), "rank 0 never finished its failing call"
    o = json.loads(report.read_text())
    assert o["type"] == "MoonEPTimeoutError" and o["is_timeout_error"], o
    assert "'dispatch:rows'" in o["msg"] and "rank 0" in o["msg"], o["msg"]
    assert o["elapsed_s"] <= TIMEOUT_S * 4, f"rank 0 failed after {o['elapsed_s']:.1f} s"
    assert o["held_before_destroy"] > 0 and o["residue_after_destroy"] == [], o
    assert elapsed < 90, f"the faulty run took {elapsed:.1f} s"
    assert _new_dev_shm(before) == []
