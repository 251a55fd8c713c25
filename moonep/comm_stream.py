"""Asynchronous moonep calls on a communication stream (Buffer.dispatch_async / combine_async /
reduce_grad_async).

An async call queues the same kernels and device barriers as the synchronous call, on the
buffer's communication stream instead of the caller's, and returns a `CommEvent`:

    res, done = buf.dispatch_async(x, w, topk)   # comm stream: waits for the caller's work so far
    shared = shared_expert(x)                    # caller's stream: runs while the tokens move
    done.wait()                                  # caller's stream waits; res may be read from here on

Ordering rules (no host synchronisation anywhere):
- the communication stream first waits for everything the calling stream has queued, so inputs
  are ready and earlier calls on the buffer are finished;
- every later call on the buffer (synchronous: at its start, before it queues anything; and every
  barrier, ExpertPools.reduce_grad's too) first makes its stream wait for the last async call, so
  the kernels and device barriers of one buffer always run in the order the host issued them
  (the barrier protocol counts epochs; the planner's graph shares its input and workspace);
- the Plan an async call reads stays referenced until the call is joined, so a pooled Plan is not
  handed out again (a later plan() joins before it replays into a pool entry);
- memory: inputs are marked as used by the communication stream (record_stream), and outputs
  allocated there are marked as used by the waiting stream in `CommEvent.wait`, so the caching
  allocator reuses neither too early. Zero-copy rows in symmetric memory are not allocator
  memory: they stay valid until the next call on the buffer, as for synchronous calls.

One calling stream: the join is done by the first Buffer call (or wait_pending) after the async
call, on that call's current stream, and then forgotten; calls from a second stream would not wait
again. moontrain calls moonep from the default stream only (autograd runs backward on it too).

On the CPU (no streams) the async calls run synchronously and return a completed CommEvent.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class CommEvent:
    """Completion of one async moonep call; `wait()` orders it before the caller's next work."""

    def __init__(self, event: torch.cuda.Event | None = None, device: torch.device | None = None,
                 outputs: Iterable[torch.Tensor] = ()) -> None:
        self.event, self.device = event, device
        self._outputs = [t for t in outputs if t is not None and t.device.type == "cuda"]

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current stream) wait for the call; never blocks the host."""
        if self.event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for t in self._outputs:
            t.record_stream(stream)

    def query(self) -> bool:
        """True once the call has finished on the device (a CPU call always has)."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block the host until the call has finished (debugging, tests)."""
        if self.event is not None:
            self.event.synchronize()


class CommStream:
    """The communication stream of one buffer and the event of its last async call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._pending: torch.cuda.Event | None = None
        self._keep: list[object] = []  # objects the pending calls read (e.g. their Plans), until joined

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream (created on first use; None on the CPU)."""
        if self._stream is None and self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def join(self) -> None:
        """Make the current stream wait for the last async call (at the start of every Buffer call
        and before every barrier), then drop the references kept for it. Nothing inside an async
        call (the communication stream is already ordered after the earlier ones) or while a graph
        is captured (the capture happens inside a call that joined at its start, and an event
        recorded outside a capture cannot be waited on in it)."""
        if self._pending is None or torch.cuda.is_current_stream_capturing():
            return
        current = torch.cuda.current_stream(self.device)
        if current == self._stream:
            return
        current.wait_event(self._pending)
        self._pending = None
        self._keep.clear()

    def run(self, fn, inputs: Iterable[torch.Tensor | None], keep: Iterable[object] = ()):
        """fn() queued on the communication stream after the caller's work -> (result, CommEvent);
        the outputs to protect are the tensors of the result (see the module docstring). `keep`:
        objects held until the call is joined, e.g. a Plan whose pooled tensors the call reads (a
        later plan() joins before it rewrites a pool entry)."""
        stream = self.stream
        if stream is None:
            return fn(), CommEvent()
        caller = torch.cuda.current_stream(self.device)
        # the last async call is earlier on this same stream: the caller need not wait for it
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            result = fn()
        for t in inputs:
            if t is not None:
                t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        self._pending = event
        self._keep.extend(keep)
        return result, CommEvent(event, self.device, _tensors(result))


def _tensors(obj) -> list[torch.Tensor]:
    """The distinct allocator-owned tensors inside a call's result (tuples, NamedTuples, a Plan)."""
    found: dict[int, torch.Tensor] = {}

    def visit(o) -> None:
        if isinstance(o, torch.Tensor):
            found.setdefault(o.untyped_storage().data_ptr(), o)
        elif isinstance(o, (tuple, list)):
            for v in o:
                visit(v)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:
                visit(getattr(o, name))

    visit(obj)
    return list(found.values())
