"""run_batch: one hand-off per device per batch gives the numbers of the step-by-step manager
calls (load_data_batch, forward, backward, step), bit for bit, on every path it takes."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from torch import nn

from fitdp.call.interrupts import GUARD
from fitdp.compiled.losses import Objective
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager


def net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 4))


def batches(n: int = 4, rows: int = 12, ignored: bool = False) -> list[DataBatch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        y = torch.randint(0, 4, (rows,), generator=g)
        if ignored:  # per-token style labels: some targets ignored (-100)
            y[torch.rand(rows, generator=g) < 0.3] = -100
        out.append(DataBatch(torch.randn(rows, 6, generator=g), y))
    return out


def managers(devices: list[str], loads: list[float] | None, dropout: float = 0.0,
             ) -> tuple[DataParallelExecutorManager, DataParallelExecutorManager]:
    loss = Objective("cross_entropy")
    made = [DataParallelExecutorManager(net(dropout), devices, work_load_list=loads, loss=loss)
            for _ in range(2)]
    return made[0], made[1]


def stepwise(mgr: DataParallelExecutorManager, opt: torch.optim.Optimizer, batch: DataBatch,
             zero: bool, step: bool) -> None:
    if zero:
        mgr.zero_grad()
    mgr.load_data_batch(batch)
    mgr.forward(is_train=True)
    mgr.backward(reduce=False)
    if step:
        mgr.step(opt)


def weights(mgr: DataParallelExecutorManager) -> list[torch.Tensor]:
    return [p.detach().clone() for row in mgr.param_arrays for p in row]


@pytest.mark.parametrize("devices,loads", [(["cpu"], None), (["cpu", "cpu"], None),
                                           (["cpu"] * 3, [1.0, 2.0, 3.0])])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("ignored", [False, True], ids=["rows", "counted"])
def test_run_batch_is_bitwise_the_stepwise_calls(devices, loads, opt_cls, ignored):
    a, b = managers(devices, loads)
    opts = [opt_cls(m.master_parameters(), lr=0.05) for m in (a, b)]
    accum = 2  # two batches per optimizer step: zeroing and accumulating both run
    for i, batch in enumerate(batches(6, ignored=ignored)):
        zero, step = i % accum == 0, i % accum == accum - 1
        stepwise(a, opts[0], batch, zero, step)
        b.run_batch(batch, True, zero_grad=zero, optimizer=opts[1] if step else None)
    for x, y in zip(weights(a), weights(b)):
        assert torch.equal(x, y)
    # (a device whose targets are all ignored logs a NaN mean, on both paths)
    torch.testing.assert_close(a.loss_state(), b.loss_state(), rtol=0, atol=0, equal_nan=True)


def test_sample_weights_and_a_short_last_batch_match_too():
    a, b = managers(["cpu", "cpu", "cpu"], None)
    opts = [torch.optim.SGD(m.master_parameters(), lr=0.1) for m in (a, b)]
    g = torch.Generator().manual_seed(2)
    data = [DataBatch(torch.randn(rows, 6, generator=g), torch.randint(0, 4, (rows,), generator=g),
                      sample_weight=torch.rand(rows, generator=g)) for rows in (9, 9, 2)]
    for batch in data:  # the last batch leaves the third device without rows
        stepwise(a, opts[0], batch, True, True)
        b.run_batch(batch, True, zero_grad=True, optimizer=opts[1])
    for x, y in zip(weights(a), weights(b)):
        assert torch.equal(x, y)


def test_dropout_replicas_draw_in_device_order_and_reproduce():
    """Regression: CPU replicas running forwards at once drew dropout masks in whichever order
    their threads reached the generator; in one hand-off they still draw in device order."""
    runs = []
    for path in ("stepwise", "run_batch", "run_batch"):
        a, _ = managers(["cpu", "cpu"], None, dropout=0.5)
        opt = torch.optim.SGD(a.master_parameters(), lr=0.1)
        torch.manual_seed(5)
        for batch in batches(5):
            if path == "stepwise":
                stepwise(a, opt, batch, True, True)
            else:
                a.run_batch(batch, True, zero_grad=True, optimizer=opt)
        assert a.execgrp.stochastic is True
        runs.append(weights(a))
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)


class FailsOnDevice1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("replica 1 broke")
        return self.lin(x)


def test_a_failing_device_leaves_every_weight_as_it_was():
    mgr = DataParallelExecutorManager(FailsOnDevice1(), ["cpu", "cpu"],
                                      loss=Objective("cross_entropy"))
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    first, second = batches(2)
    mgr.run_batch(first, True, zero_grad=True, optimizer=opt)
    before = weights(mgr)
    mgr.execgrp.executors[1].module.fail = True
    with pytest.raises(RuntimeError, match="replica 1 broke"):
        mgr.run_batch(second, True, zero_grad=True, optimizer=opt)
    for x, y in zip(before, weights(mgr)):
        assert torch.equal(x, y)
    mgr.execgrp.executors[1].module.fail = False
    mgr.run_batch(second, True, zero_grad=True, optimizer=opt)  # threads still serve
    assert not torch.equal(before[0], weights(mgr)[0])
    mgr.close()


class InterruptsOnDevice0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the batch
        return self.lin(x)


def test_ctrl_c_during_the_batch_is_raised_after_its_optimizer_step():
    mgr = DataParallelExecutorManager(InterruptsOnDevice0(), ["cpu", "cpu"],
                                      loss=Objective("cross_entropy"))
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    before = weights(mgr)
    mgr.execgrp.executors[0].module.armed = True
    with GUARD.installed(), pytest.raises(KeyboardInterrupt):
        mgr.run_batch(batches(1)[0], True, zero_grad=True, optimizer=opt,
                      guard=GUARD.critical())
    after = [[p.detach() for p in row] for row in mgr.param_arrays]
    assert not torch.equal(before[0], after[0][0])  # the step happened, whole
    for row in after:
        assert torch.equal(row[0], row[1])  # and reached every replica
    mgr.close()


def test_views_follow_a_scheduler_and_a_loaded_state():
    """The step's update is bound once per call: a new learning rate or a loaded state
    dict must still reach the optimizer step it takes."""
    a, b = managers(["cpu", "cpu"], None)
    opts = [torch.optim.Adam(m.master_parameters(), lr=0.01) for m in (a, b)]
    data = batches(4)
    for i, batch in enumerate(data):
        if i == 2:
            for opt in opts:
                opt.param_groups[0]["lr"] = 0.1
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        stepwise(a, opts[0], batch, True, True)
        b.run_batch(batch, True, zero_grad=True, optimizer=opts[1])
    for x, y in zip(weights(a), weights(b)):
        assert torch.equal(x, y)


def test_labels_changed_in_place_are_counted_again():
    """The proof that no target is ignored is kept per label tensor while its version is
    unchanged: ignoring targets in place afterwards must weigh the devices by counts again."""
    a, b = managers(["cpu", "cpu"], None)
    opts = [torch.optim.SGD(m.master_parameters(), lr=0.1) for m in (a, b)]
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(24, 6, generator=g), torch.randint(0, 4, (24,), generator=g)
    for step in range(2):
        if step == 1:
            y[:5] = -100  # every ignored target on device 0's half of the first batch
        for i in (0, 12):
            batch = DataBatch(x[i:i + 12], y[i:i + 12])  # views of y, as TensorSource's
            stepwise(a, opts[0], batch, True, True)
            b.run_batch(batch, True, zero_grad=True, optimizer=opts[1])
    for p, q in zip(weights(a), weights(b)):
        assert torch.equal(p, q)


def test_one_replica_logs_the_counted_loss_again_after_labels_change_in_place():
    """One CPU replica takes the batch's own tensors (no copy) and weighs its logged loss by
    the targets it means over; labels found to ignore none are counted again once changed in
    place (their version), so the logged loss stays the mean over the counted targets."""
    mgr = DataParallelExecutorManager(net(), ["cpu"], loss=Objective("cross_entropy"))
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(24, 6, generator=g), torch.randint(0, 4, (24,), generator=g)
    for changed in (False, True):
        if changed:
            y[:5] = -100  # ignored targets in the first batch
        mgr.reset_loss()
        expected_sum, expected_count = 0.0, 0
        for i in (0, 12):
            batch = DataBatch(x[i:i + 12], y[i:i + 12])  # views of y, as TensorSource's
            mgr.run_batch(batch, True)
            assert mgr.execgrp.executors[0].inputs is batch.data
            kept = int((batch.label != -100).sum())
            with torch.no_grad():
                loss = nn.functional.cross_entropy(mgr.outputs()[0], batch.label)
            expected_sum += float(loss) * kept
            expected_count += kept
        total, count = mgr.loss_state()
        assert int(count) == expected_count == (19 if changed else 24)
        assert float(total) == pytest.approx(expected_sum, rel=1e-6)
    mgr.close()


def test_a_source_batch_is_the_batch_the_constructor_makes():
    x, y, w = torch.randn(3, 2), torch.zeros(3, dtype=torch.long), torch.ones(3)
    made, fast = DataBatch(x, y, global_rows=6, sample_weight=w), DataBatch.of_rows(x, y, 6, w)
    assert vars(fast) == vars(made) and list(vars(fast)) == list(vars(made))


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu"] * 3])
def test_a_parameter_backward_leaves_without_gradient_steps_as_with_zeros(devices):
    """Fresh gradients leave an unused parameter's at None; the zeroed buckets give it zeros,
    and AdamW decays a parameter with a zero gradient (it skips one without): the same."""
    made = [DataParallelExecutorManager(WithUnused(), devices, loss=Objective("cross_entropy"))
            for _ in range(2)]
    opts = [torch.optim.AdamW(m.master_parameters(), lr=0.1, weight_decay=0.5) for m in made]
    for batch in batches(3):
        stepwise(made[0], opts[0], batch, True, True)
        made[1].run_batch(batch, True, zero_grad=True, optimizer=opts[1])
    for x, y in zip(weights(made[0]), weights(made[1])):
        assert torch.equal(x, y)
    assert not torch.equal(made[1].param_arrays[2][0], WithUnused().unused.weight)  # decayed
