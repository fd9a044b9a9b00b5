"""work_load_list="auto" (LoadBalancer), from injected timings and from replicas slowed on
purpose."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

from fitdp.compiled.losses import Objective
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager
from fitdp.executor.balance import LoadBalancer
from fitdp.executor.slicing import split_input_slice


def test_loads_follow_the_measured_speeds():
    lb = LoadBalancer(3, window=3, warmup=1)
    assert lb.record([10, 10, 10], [9.0, 9.0, 9.0]) is None  # warm-up batch: not counted
    for _ in range(2):
        assert lb.record([10, 10, 10], [0.01, 0.02, 0.04]) is None
    loads = lb.record([10, 10, 10], [0.01, 0.02, 0.04])
    assert loads == pytest.approx([12 / 7, 6 / 7, 3 / 7], abs=1e-3)  # speeds 4 : 2 : 1
    assert lb.loads == loads and lb.balanced


def test_balanced_loads_stay_until_the_times_drift_apart():
    lb = LoadBalancer(2, window=2, warmup=0, drift=1.15)
    lb.record([50, 50], [0.01, 0.02])
    first = lb.record([50, 50], [0.01, 0.02])
    assert first is not None
    for _ in range(4):  # finishing together (within the drift): nothing to do
        assert lb.record([67, 33], [0.0100, 0.0105]) is None
    lb.record([67, 33], [0.010, 0.030])  # device 1 slowed down again
    again = lb.record([67, 33], [0.010, 0.030])
    assert again is not None and again[0] > first[0]


def test_batches_with_an_idle_device_tell_nothing():
    lb = LoadBalancer(2, window=1, warmup=0)
    assert lb.record([3, 0], [0.01, 0.0]) is None and not lb.balanced


def test_no_device_is_left_without_rows():
    lb = LoadBalancer(2, window=1, warmup=0)
    loads = lb.record([16, 16], [0.001, 10.0])  # device 1 ten thousand times slower
    assert loads is not None
    rows = [s.stop - s.start for s in split_input_slice(32, loads)]
    assert rows[0] > 16 and rows[1] >= 1  # still gets rows, so it is measured again


class PerRowDelay(nn.Module):
    """A replica that takes ``delay`` seconds per row (sleeping: a device that slow)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay * x.shape[0])
        return self.lin(x)


def test_auto_loads_balance_a_slowed_replica_and_keep_the_whole_batch_update(caplog):
    torch.manual_seed(0)
    host = PerRowDelay()
    ref = PerRowDelay()
    ref.load_state_dict(host.state_dict())
    mgr = DataParallelExecutorManager(host, ["cpu", "cpu"], work_load_list="auto",
                                      loss=Objective("cross_entropy"))
    # Half a ms per row: a share takes 10-40 ms, well above the few ms a thread waits for
    # a core on a loaded 2-core machine (at 0.1 ms per row it failed 1 run in 4 at load 6).
    mgr.execgrp.executors[0].module.delay = 0.0005
    mgr.execgrp.executors[1].module.delay = 0.0015  # a third of device 0's speed
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    with caplog.at_level(logging.INFO, logger="fitdp"):
        for _ in range(12):
            x, y = torch.randn(48, 5, generator=g), torch.randint(0, 3, (48,), generator=g)
            mgr.run_batch(DataBatch(x, y), True, zero_grad=True, optimizer=opt)
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(x), y).backward()
            ref_opt.step()
    loads = mgr.work_load_list
    assert 2.0 < loads[0] / loads[1] < 4.5, loads  # about 3 : 1
    assert mgr.slices[0].stop > 30  # the split in use is uneven
    lines = [r.getMessage() for r in caplog.records if "work_load_list='auto'" in r.getMessage()]
    assert lines and str(loads) in lines[-1]
    for p, q in zip(mgr.master_parameters(), ref.parameters()):  # the whole batch's update
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    mgr.close()


def test_auto_is_checked_and_turned_off():
    mgr = DataParallelExecutorManager(nn.Linear(2, 2), ["cpu", "cpu"], work_load_list="auto")
    assert mgr.balancer is not None and mgr.work_load_list == [1.0, 1.0]
    mgr.set_work_load_list([1, 3])
    assert mgr.balancer is None and mgr.work_load_list == [1.0, 3.0]
    assert mgr.slices_for(8) == [slice(0, 2), slice(2, 8)]
    # A string of the wrong value is a ValueError since a4448f8 (right type, wrong value).
    with pytest.raises(ValueError, match="work_load_list: got 'Auto'; expected 'auto'"):
        mgr.set_work_load_list("Auto")
    mgr.close()
