"""The job's rendezvous store on one host: a TCPStore that `moontrain launch` hosts on 127.0.0.1 only.

torchrun's TCPStore servers (the rendezvous store, and the one the workers share for init_process_group)
listen on every interface of the host whatever host name they are given, without authentication: any host
that can reach the port can read and write the keys the job coordinates with. On one host the job needs
none of that, so the launcher binds its own socket to 127.0.0.1 and hands it to a TCPStore server
(`master_listen_fd`); torchrun's agent joins it as a client (`--rdzv-conf is_host=false`), torchrun shares no
store of its own with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and each worker builds its process
group on this store (`worker_store`, named by MOONTRAIN_STORE), under a prefix per torchrun restart. gloo's
own connections are kept on the loopback interface too (GLOO_SOCKET_IFNAME=lo, unless set).

Loopback keeps other hosts out, not other users of this host: TCP has no owner check. What the job does
with the store is therefore limited to what a stranger writing keys can only disturb, not redirect (the
heartbeat kills no pid it reads from the store: moontrain.parallel.heartbeat). docs/security.md has the
whole picture. Several nodes rendezvous through torchrun's c10d store on the --rdzv-endpoint host, which
listens on all its interfaces: a private network between the nodes is assumed there.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta

import torch.distributed as dist

STORE_ENV = "MOONTRAIN_STORE"  # host:port of the launcher's store, for the workers
LOOPBACK = "127.0.0.1"


class JobStore:
    """The store server of one single-host launch, alive as long as this object (the launcher's process)."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((LOOPBACK, 0))
        self._socket.listen(128)
        self.port = self._socket.getsockname()[1]
        self.store = dist.TCPStore(LOOPBACK, self.port, is_master=True, master_listen_fd=self._socket.fileno(),
                                   wait_for_workers=False, multi_tenant=True)
        self._socket.detach()  # the store's server owns the descriptor now

    def torchrun_args(self) -> list[str]:
        """torchrun's rendezvous options: join this store as a client (replaces --standalone)."""
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{self.port}",
                "--rdzv-id", f"moontrain-{uuid.uuid4().hex[:12]}", "--rdzv-conf", "is_host=false"]

    def env(self) -> dict[str, str]:
        """What torchrun and the workers need in their environment."""
        return {STORE_ENV: f"{LOOPBACK}:{self.port}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}

    def close(self) -> None:
        del self.store  # the last reference: the server stops and closes its socket


def worker_store(timeout_s: float) -> dist.Store | None:
    """The launcher's store for this worker's process group (None when not started by a single-host
    `moontrain launch`: torchrun's env:// rendezvous then), its keys under a prefix per torchrun restart."""
    address = os.environ.get(STORE_ENV)
    if not address:
        return None
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"moontrain/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
