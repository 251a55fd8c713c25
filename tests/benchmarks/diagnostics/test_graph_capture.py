"""graph_capture's sync listing (the GPU part needs a GPU; this is its bookkeeping): each sync warning counted by
message and site, the sync debug mode's own prototype notice and other warnings passed over, the mode reset and
the warning machinery restored even when the pass raises."""

from __future__ import annotations

import warnings

import pytest
import torch

from benchmarks.diagnostics import graph_capture as gc


def test_sync_warnings_are_counted_by_site(monkeypatch) -> None:
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    show = warnings.showwarning

    def one_pass() -> None:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                      "operations", stacklevel=1)
        warnings.warn("not a sync", stacklevel=1)

    with pytest.warns(UserWarning, match="not a sync"):
        sites = gc.find_syncs(one_pass)
    assert sites == {"called a synchronizing CUDA operation at (no frame)": 3}
    assert modes == ["warn", 0] and warnings.showwarning is show

    def failing_pass() -> None:
        raise RuntimeError("capture")

    with pytest.raises(RuntimeError, match="capture"):
        gc.find_syncs(failing_pass)
    assert modes == ["warn", 0, "warn", 0] and warnings.showwarning is show
