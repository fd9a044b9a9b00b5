"""Each device's time on its share of a batch, for ``work_load_list="auto"``, with no host
sync on a CUDA device.

On the CPU a share's time is the ``perf_counter`` difference its thread reads as the share
ends (``device_share``): the work is done when the call returns. A CUDA device's share ends on
the host long before the device has run it; reading the clock there would need
``torch.cuda.synchronize`` on every device every step while balancing, the host sync the
design promises away between log points. So on a CUDA device a pair of CUDA events marks the
share on the device's current stream, and the batch's times are read once every one of its
events has run (``Event.query()``, which does not wait): usually a batch or two later. The
balancer then decides from slightly older batches; it needs a window of them anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

# Batches whose events are still pending, at most; past it the oldest is dropped unread (a
# device that far behind the host is not one to time from a few batches ago).
MAX_PENDING = 64


class ShareClock:
    """Times each device's share of a batch: the host clock on the CPU, CUDA events on a CUDA
    device (read later, without waiting).

    ``begin(d)`` and ``end(d)`` run on device ``d``'s thread around its share; after the
    batch, ``finished(rows, times)`` gives the (rows, seconds) of every batch whose times are
    now known, oldest first. With no CUDA device that is the batch just run, always.

    Args:
        devices: the devices, in order.

    Example:
        >>> clock = ShareClock([torch.device("cpu")] * 2)
        >>> clock.finished([4, 4], [0.01, 0.02])
        [([4, 4], [0.01, 0.02])]
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.cuda = [d.type == "cuda" for d in self.devices]
        self.any_cuda = any(self.cuda)
        # This batch's (start, end) events per device; None on the CPU.
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event] | None] = [None] * len(
            self.devices)
        self._pending: deque[tuple[list[int], list[float], list[tuple | None]]] = deque()
        # Events are made once and reused; one pool per device (an event records only on the
        # device it was first recorded on, and each pool is taken from by one thread).
        self._free: list[list[torch.cuda.Event]] = [[] for _ in self.devices]

    def begin(self, d: int) -> None:
        """Device ``d``'s share starts (on its thread): on CUDA, a start event on the
        device's current stream."""
        if self.cuda[d]:
            start, end = self._event(d), self._event(d)
            start.record(torch.cuda.current_stream(self.devices[d]))
            self.marks[d] = (start, end)

    def end(self, d: int) -> None:
        """Device ``d``'s share ends (on its thread): on CUDA, its end event."""
        marks = self.marks[d]
        if marks is not None:
            marks[1].record(torch.cuda.current_stream(self.devices[d]))

    def finished(self, rows: Sequence[int], times: Sequence[float]
                 ) -> list[tuple[list[int], list[float]]]:
        """After a batch with each device's ``rows`` and host-clock ``times``: (rows,
        seconds) of every batch whose shares' times are known now, oldest first. A CUDA
        device's seconds are its events' elapsed time, read only once they have run."""
        if not self.any_cuda:
            return [(list(rows), list(times))]
        self._pending.append((list(rows), list(times), list(self.marks)))
        self.marks = [None] * len(self.devices)
        if len(self._pending) > MAX_PENDING:
            self._release(self._pending.popleft()[2])
        done = []
        while self._pending and all(m is None or m[1].query() for m in self._pending[0][2]):
            batch_rows, seconds, marks = self._pending.popleft()
            for d, m in enumerate(marks):
                if m is not None:
                    seconds[d] = m[0].elapsed_time(m[1]) / 1e3  # it gives ms
            self._release(marks)
            done.append((batch_rows, seconds))
        return done

    def forget(self) -> None:
        """Drop the batches still pending (they measured loads no longer in use)."""
        while self._pending:
            self._release(self._pending.popleft()[2])

    def _event(self, d: int) -> torch.cuda.Event:
        free = self._free[d]
        return free.pop() if free else torch.cuda.Event(enable_timing=True)

    def _release(self, marks: Sequence[tuple | None]) -> None:
        for d, m in enumerate(marks):
            if m is not None:
                self._free[d].extend(m)
