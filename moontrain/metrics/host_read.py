"""Device values read on the host later, without draining the device's queue.

`HostRead(values)` enqueues a copy of `values` into pinned host memory behind the work already queued on
the current stream, and records an event after it; `read()` waits for that event alone, so the work
queued after the copy (the next step's forward and backward) keeps the device busy while the host reads.
A plain `.tolist()` at the same point would wait for the whole queue and leave the device idle until
the host has launched enough new work (launch-bound stretches at the start of every step).

On a CPU device the values are read as they are (the ops ran when they were called). `waited_s`: how long
`read` waited for the device; the trainer logs it per step (`time/device_wait_ms`): near zero in a pipelined
run means the device finished before the host asked, i.e. the host, not the device, sets the pace.
"""

from __future__ import annotations

import time

import torch


class HostRead:
    def __init__(self, values: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        self.waited_s = 0.0
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
            t0 = time.perf_counter()
            self.event.synchronize()
            self.waited_s = time.perf_counter() - t0
        return self.host.tolist()
