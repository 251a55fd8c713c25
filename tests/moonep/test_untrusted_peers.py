"""moonep against a careless or hostile neighbour (2 gloo ranks each):

- a process of the same user that connects first to a rank's fd-exchange socket (its name is listed in
  /proc/net/unix) gets no descriptor of the heap, is named in a RuntimeWarning, and the exchange between
  the real ranks completes; before, it received a writable mapping of the rank's heap and the job died
  with a reset connection;
- combine with a plan whose rows these are not (a plan no dispatch used, or the receive rows of the last
  dispatch with another plan) is a ValueError; before, it summed other rows silently. Combine with an
  earlier dispatched plan and that dispatch's cloned rows stays correct (bitwise: K * x).

References: the bytes each rank wrote into its memfd; K * x for combined identity rows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions
from moonep.heap.fd_exchange import close_fds, exchange_fds
from tests.dist_utils import run_ranks

_INTRUDER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
sock.connect(sys.argv[1].replace("@", "\\0", 1))
try:
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 4, 250)
    if fds:
        sock.sendall(b"k")
    print(len(fds))
except OSError as err:
    print(f"0 ({type(err).__name__})")
"""


def _own_listening_socket_name() -> str:
    """The abstract name of the moonep socket this process listens on (its inode among this process's fds)."""
    inodes = {m.group(1) for fd in os.listdir("/proc/self/fd")
              if (m := re.fullmatch(r"socket:\[(\d+)\]", _readlink(f"/proc/self/fd/{fd}")))}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 8 and parts[6] in inodes and parts[7].startswith("@moonep-") and parts[5] == "01":
            return parts[7]
    raise AssertionError("no moonep socket of this process is listening")


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _exchange_with_an_intruder(rank: int, world: int) -> dict:
    fd = os.memfd_create("moonep-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, f"heap of rank {rank}".encode(), 0)
    intruder: list[str] = []

    def barrier(call: str) -> None:
        if rank == 1:  # rank 1 listens; rank 0 waits in the barrier below: the intruder connects first
            name = _own_listening_socket_name()
            proc = subprocess.run([sys.executable, "-c", _INTRUDER, name], capture_output=True, text=True,
                                  timeout=30)
            intruder.append(proc.stdout.strip() or proc.stderr[-500:])
        dist.barrier()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fds = exchange_fds([fd], group=dist.group.WORLD, barrier=barrier, timeout_s=20)
    peer = fds[1 - rank][0]
    content = os.pread(peer, 14, 0).decode()
    close_fds([fd, peer])
    return {"intruder": intruder, "peer": content, "warnings": [str(w.message) for w in caught]}


def test_fd_exchange_refuses_foreign_peer() -> None:
    out = run_ranks(_exchange_with_an_intruder, 2, timeout_s=90)
    assert [o["peer"] for o in out] == ["heap of rank 1", "heap of rank 0"]
    assert out[1]["intruder"] == ["0"], out[1]  # no descriptor reached it
    (warning,) = out[1]["warnings"]
    assert re.fullmatch(r"moonep fd exchange: rank 1 refused a connection from pid \d+ \(uid \d+\): not a peer rank "
                        r"of its group \(pids \[\d+\], uid \d+\); its heap descriptors go to the group's ranks only",
                        warning), warning
    assert out[0]["warnings"] == []


S, H, K, E = 8, 32, 2, 4


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    w = torch.rand(S, K, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(torch.int32)
    return x, w, topk


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _combine_with_another_plan(rank: int, world: int) -> dict:
    buf = Buffer(BufferConfig(max_tokens=S, hidden=H, topk=K, num_experts=E, token_padding=4,
                              options=BufferOptions(timeout_s=30)))
    try:
        x, w, topk_a = _routing(10 + rank)
        _, _, topk_b = _routing(20 + rank)
        plan_a = buf.plan(topk_a)
        res_b = buf.dispatch(x, w, topk_b)
        out = {"never dispatched": _outcome(lambda: buf.combine(plan_a, res_b.x_rows.clone()))}
        rows_a = buf.dispatch(x, w, plan=plan_a).x_rows.clone()
        res_b = buf.dispatch(x, w, plan=res_b.plan)
        out["receive rows of another plan"] = _outcome(lambda: buf.combine(plan_a, res_b.x_rows))
        y_a, _ = buf.combine(plan_a, rows_a)  # an earlier plan with its own (cloned) rows: allowed, correct
        y_b, _ = buf.combine(res_b.plan, res_b.x_rows)
        want = (x.float() * K).to(torch.bfloat16)  # K equal bf16 rows summed in fp32: exact
        out["earlier plan, its rows"] = bool(torch.equal(y_a, want))
        out["last plan, receive rows"] = bool(torch.equal(y_b, want))
        return out
    finally:
        buf.destroy()


def test_combine_refuses_rows_of_another_plan() -> None:
    for out in run_ranks(_combine_with_another_plan, 2, timeout_s=90):
        assert out["earlier plan, its rows"] and out["last plan, receive rows"], out
        assert out["never dispatched"].startswith("combine got a plan that no dispatch of this Buffer used"), out
        assert out["receive rows of another plan"].startswith(
            "combine got rows of the receive buffer, which hold the last dispatch's rows, with another plan"), out
