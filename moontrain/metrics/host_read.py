"""Device values read on the host later, without draining the device's queue.

`HostRead(values)` enqueues a copy of `values` into pinned host memory behind the work already queued on
the current stream, and records an event after it; `read()` waits for that event alone, so the work
queued after the copy (the next step's forward and backward) keeps the device busy while the host reads.
A plain `.tolist()` at the same point would wait for the whole queue and leave the device idle until
the host has launched enough new work (launch-bound stretches at the start of every step).

On a CPU device the values are read as they are (the ops ran when they were called).
"""

from __future__ import annotations

import torch


class HostRead:
    def __init__(self, values: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def read(self) -> list:
        """The values as Python numbers (a nested list for more than one dimension)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
