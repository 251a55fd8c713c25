"""All-to-all exchange of file descriptors between the ranks of one host, with every peer checked.

Both heap backends export each rank's physical allocation as a POSIX file descriptor (a memfd on
CPU, a cuMemExportToShareableHandle descriptor on GPU) and hand it to every peer over a Unix
socket with SCM_RIGHTS. Sockets live in the abstract namespace (the name starts with a NUL byte),
so nothing is ever created on the file system and nothing survives a rank that dies.

A descriptor is a writable mapping of the rank's heap, so it goes only to a rank of the group. An
abstract socket has no permissions and its name is listed in /proc/net/unix for every user to see,
so the kernel's word on who is at the other end decides (SO_PEERCRED, fixed at connect / listen):
the server hands its descriptors only to a connection from this uid and from the pid of a peer
rank, and the client accepts descriptors only from this uid and the pid of the rank it asked for.
A refused connection is closed and named in a RuntimeWarning; the exchange goes on with the real
peers. Each rank draws its own random name, so no name can be derived from another one and taken
first. The ranks' pids come from the group (one all_gather_object): on one host, in one pid
namespace, as torchrun starts them.

Protocol (collective over `group`): every rank binds and listens on ``\\0moonep-<random>``; one
all_gather_object of (pid, name) (every rank listens before any rank learns a name); the barrier;
then each rank serves its descriptors to R-1 checked peers from a thread while it connects to every
peer in turn to receive theirs.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
import warnings
from collections.abc import Callable, Sequence

import torch.distributed as dist

_MAX_FDS_PER_MSG = 250  # SCM_RIGHTS carries at most 253 descriptors per message on Linux.
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket, from the kernel."""
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _serve(server: socket.socket, fds: Sequence[int], peer_pids: set[int], rank: int,
           errors: list[BaseException]) -> None:
    served: set[int] = set()
    try:
        while served != peer_pids:
            conn, _addr = server.accept()
            with conn:
                pid, uid = peer_credentials(conn)
                if uid != os.getuid() or pid not in peer_pids - served:
                    warnings.warn(f"moonep fd exchange: rank {rank} refused a connection from pid {pid} (uid {uid}): "
                                  f"not a peer rank of its group (pids {sorted(peer_pids)}, uid {os.getuid()}); its "
                                  "heap descriptors go to the group's ranks only", RuntimeWarning, stacklevel=1)
                    continue
                for start in range(0, len(fds), _MAX_FDS_PER_MSG):
                    chunk = list(fds[start : start + _MAX_FDS_PER_MSG])
                    socket.send_fds(conn, [len(chunk).to_bytes(4, "little")], chunk)
                conn.recv(1)  # wait for the peer's acknowledgement before closing
                served.add(pid)
    except BaseException as exc:  # reported by the caller's thread
        errors.append(exc)


def _receive(name: str, peer: int, peer_pid: int, num_fds: int, timeout_s: float) -> list[int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(name)
        pid, uid = peer_credentials(sock)
        if (pid, uid) != (peer_pid, os.getuid()):
            raise ConnectionRefusedError(f"moonep fd exchange: the socket of rank {peer} is held by pid {pid} (uid "
                                         f"{uid}), not by rank {peer} (pid {peer_pid}, uid {os.getuid()}); refusing "
                                         "its descriptors")
        received: list[int] = []
        while len(received) < num_fds:
            _msg, fds, _flags, _addr = socket.recv_fds(sock, 4, _MAX_FDS_PER_MSG)
            if not fds:
                raise ConnectionError(f"moonep fd exchange: rank {peer} closed the socket early")
            received.extend(fds)
        sock.sendall(b"k")
        return received


def exchange_fds(
    local_fds: Sequence[int],
    *,
    group: dist.ProcessGroup,
    barrier: Callable[[str], None],
    timeout_s: float,
) -> list[list[int]]:
    """Return ``fds[r]`` for every rank r of ``group``: our own descriptors for r == rank, and
    freshly received duplicates of peer r's descriptors otherwise (the caller closes them).

    Every rank must pass the same number of descriptors.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return [list(local_fds)]
    name = f"\0moonep-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.settimeout(timeout_s)
    server.bind(name)
    server.listen(world)
    try:
        peers: list[tuple[int, str] | None] = [None] * world
        dist.all_gather_object(peers, (os.getpid(), name), group=group)
        pids = {r: p[0] for r, p in enumerate(peers) if r != rank and p is not None}
        errors: list[BaseException] = []
        thread = threading.Thread(target=_serve, args=(server, local_fds, set(pids.values()), rank, errors),
                                  daemon=True)
        thread.start()
        barrier("heap.exchange_fds:listen")
        result: list[list[int]] = []
        for peer in range(world):
            if peer == rank:
                result.append(list(local_fds))
            else:
                peer_pid, peer_name = peers[peer]  # type: ignore[misc]
                result.append(_receive(peer_name, peer, peer_pid, len(local_fds), timeout_s))
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"moonep fd exchange: rank {rank} served its descriptors to fewer than "
                               f"{world - 1} peers within {timeout_s} s")
        if errors:
            raise errors[0]
        return result
    finally:
        server.close()


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
