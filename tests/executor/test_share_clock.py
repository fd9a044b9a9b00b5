"""work_load_list="auto" times each device's share: the host clock on the CPU, as it was;
CUDA events read once they have run on a CUDA device, with no host sync (issue 21 item 5)."""

from __future__ import annotations

import torch
from torch import nn

from fitdp.compiled.losses import Objective
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager
from fitdp.executor.balance import LoadBalancer
from fitdp.executor.share_clock import ShareClock


class FakeEvent:
    """A CUDA event whose completion the test decides: ``query()`` is ``done``."""

    def __init__(self, ms: float) -> None:
        self.ms, self.done = ms, False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "read before the events had run"
        return end.ms - self.ms


def mark(clock: ShareClock, d: int, ms: float) -> tuple[FakeEvent, FakeEvent]:
    """What ``begin``/``end`` leave on a CUDA device: a share of ``ms`` milliseconds."""
    pair = (FakeEvent(0.0), FakeEvent(ms))
    clock.marks[d] = pair  # type: ignore[assignment]
    return pair


def test_cpu_balancer_gets_each_batch_host_times_in_that_batch(monkeypatch):
    """The CPU path is as before: every batch's own perf_counter times, at once."""
    seen: list[tuple[list[int], list[float]]] = []
    record = LoadBalancer.record

    def spy(self, rows, seconds):
        seen.append((list(rows), list(seconds)))
        return record(self, rows, seconds)

    monkeypatch.setattr(LoadBalancer, "record", spy)
    mgr = DataParallelExecutorManager(nn.Linear(5, 3), ["cpu", "cpu"], work_load_list="auto",
                                      loss=Objective("cross_entropy"))
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
        mgr.run_batch(DataBatch(x, y), True)
        assert len(seen) == i + 1 and seen[-1] == ([8, 8], mgr.balancing.times)
        assert min(seen[-1][1]) > 0
    mgr.close()


def test_cuda_times_are_read_once_their_events_have_run():
    """Without waiting: a batch whose events are pending is kept (in order) and read when
    ``query()`` says they have run; a CPU device beside it keeps its host time."""
    clock = ShareClock([torch.device("cuda:0"), torch.device("cpu")])
    first = mark(clock, 0, 4.0)
    assert clock.finished([6, 2], [0.5, 0.003]) == []  # pending
    second = mark(clock, 0, 2.0)
    assert clock.finished([5, 3], [0.5, 0.002]) == []
    for event in second:
        event.done = True
    third = mark(clock, 0, 1.0)
    assert clock.finished([4, 4], [0.5, 0.001]) == []  # the oldest still runs: in order
    for event in (*first, *third):
        event.done = True
    mark(clock, 0, 3.0)  # the batch just run: still pending
    assert clock.finished([3, 5], [0.5, 0.004]) == [([6, 2], [0.004, 0.003]),
                                                    ([5, 3], [0.002, 0.002]),
                                                    ([4, 4], [0.001, 0.001])]
    assert clock._free[0] == [*first, *second, *third]  # the events are reused


def test_pending_batches_are_dropped_when_the_loads_change():
    clock = ShareClock([torch.device("cuda:0")])
    pair = mark(clock, 0, 1.0)
    assert clock.finished([8], [0.1]) == []
    clock.forget()
    for event in pair:
        event.done = True
    assert clock.finished([8], [0.1]) == [([8], [0.1])]  # only the batch after the change
