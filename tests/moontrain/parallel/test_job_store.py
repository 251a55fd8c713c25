"""The single-host launch's store: it listens on 127.0.0.1 only, torchrun joins it as a client, and the workers
build their process group on it under a prefix per torchrun restart. (A whole launch that listens on loopback
only is checked in tests/moontrain/test_launch_faults.py.)

Reference: the kernel's socket table (/proc/net/tcp, tcp6) for the listening address.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moontrain.parallel.job_store import JobStore, worker_store

LISTEN = "0A"


def listening_on(port: int) -> list[str]:
    """The local addresses (hex, as the kernel prints them) of the sockets listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def test_single_host_store_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, torchrun's --standalone stores listened on every interface (:: / 0.0.0.0), open to other hosts."""
    store = JobStore()
    try:
        assert listening_on(store.port) == ["0100007F"]  # 127.0.0.1, and no 0.0.0.0 or :: socket
        assert store.torchrun_args()[:4] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}"]
        assert store.torchrun_args()[-2:] == ["--rdzv-conf", "is_host=false"]
        env = store.env()
        assert env["MOONTRAIN_STORE"] == f"127.0.0.1:{store.port}" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
        worker_store(10).set("k", "v")
        assert store.store.get("moontrain/restart2/k") == b"v"
    finally:
        store.close()
    monkeypatch.delenv("MOONTRAIN_STORE")
    assert worker_store(10) is None  # not under a single-host launch: torchrun's env:// rendezvous
