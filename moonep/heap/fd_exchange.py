"""All-to-all exchange of file descriptors between the ranks of one host.

Both heap backends export each rank's physical allocation as a POSIX file descriptor (a memfd on
CPU, a cuMemExportToShareableHandle descriptor on GPU) and hand it to every peer over a Unix
socket with SCM_RIGHTS. Sockets live in the abstract namespace (the name starts with a NUL byte),
so nothing is ever created on the file system and nothing survives a rank that dies.

Protocol (collective over `group`): rank 0 draws a random tag and broadcasts it; every rank binds
``\\0moonep-<tag>-<rank>`` and listens; a barrier; then each rank serves its descriptors to R-1
peers from a thread while it connects to every peer in turn to receive theirs.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence

import torch.distributed as dist

_MAX_FDS_PER_MSG = 250  # SCM_RIGHTS carries at most 253 descriptors per message on Linux.


def _socket_name(tag: str, rank: int) -> str:
    return f"\0moonep-{tag}-{rank}"


def _serve(server: socket.socket, fds: Sequence[int], num_peers: int, errors: list[BaseException]) -> None:
    try:
        for _ in range(num_peers):
            conn, _addr = server.accept()
            with conn:
                for start in range(0, len(fds), _MAX_FDS_PER_MSG):
                    chunk = list(fds[start : start + _MAX_FDS_PER_MSG])
                    socket.send_fds(conn, [len(chunk).to_bytes(4, "little")], chunk)
                conn.recv(1)  # wait for the peer's acknowledgement before closing
    except BaseException as exc:  # reported by the caller's thread
        errors.append(exc)


def _receive(tag: str, peer: int, num_fds: int, timeout_s: float) -> list[int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(_socket_name(tag, peer))
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
    tag_box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(tag_box, src=dist.get_global_rank(group, 0), group=group)
    tag = tag_box[0]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.settimeout(timeout_s)
    server.bind(_socket_name(tag, rank))
    server.listen(world)
    errors: list[BaseException] = []
    thread = threading.Thread(target=_serve, args=(server, local_fds, world - 1, errors), daemon=True)
    thread.start()
    try:
        barrier("heap.exchange_fds:listen")
        result: list[list[int]] = []
        for peer in range(world):
            if peer == rank:
                result.append(list(local_fds))
            else:
                result.append(_receive(tag, peer, len(local_fds), timeout_s))
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
