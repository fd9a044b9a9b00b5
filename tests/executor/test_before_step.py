"""The optimizer step's ``before_step`` hooks: how an async save's copy holds the next step
without the executor knowing of saving (issue 30 item 4: ``fence.pending`` was read in every
optimizer step, the executor tied to async saving)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from fitdp.compiled.losses import Objective
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager
from fitdp.saving import fence


def manager() -> tuple[DataParallelExecutorManager, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mgr = DataParallelExecutorManager(nn.Linear(4, 3), ["cpu", "cpu"],
                                      loss=Objective("cross_entropy"))
    return mgr, torch.optim.SGD(mgr.master_parameters(), lr=0.1)


def batch() -> DataBatch:
    g = torch.Generator().manual_seed(1)
    return DataBatch(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))


def test_hooks_run_before_the_weights_change_and_only_on_a_step():
    mgr, opt = manager()
    seen: list[torch.Tensor] = []
    mgr.before_step.append(lambda: seen.append(mgr.master_parameters()[0].detach().clone()))
    before = mgr.master_parameters()[0].detach().clone()
    mgr.run_batch(batch(), True, zero_grad=True)  # no optimizer: no step, no hook
    assert seen == []
    mgr.run_batch(batch(), True, zero_grad=True, optimizer=opt)
    assert len(seen) == 1 and torch.equal(seen[0], before)  # run before the update
    assert not torch.equal(mgr.master_parameters()[0], before)
    mgr.close()


def test_a_pending_copy_holds_the_next_step_and_its_wait_leaves_after():
    """What Model.save(async_save=True) does: ``hold`` the copy, ``fence_steps`` the
    manager. The step waits for the copy; once it is done the hook takes itself out."""
    mgr, opt = manager()
    copied = threading.Event()
    fence.hold(copied)
    try:
        fence.fence_steps(mgr.before_step)
        fence.fence_steps(mgr.before_step)  # once, however often asked
        assert len(mgr.before_step) == 1
        order: list[str] = []
        real_step = opt.step

        def step(*args, **kwargs):
            order.append("step")
            return real_step(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]

        def finish_copy() -> None:
            order.append("copied")
            copied.set()

        timer = threading.Timer(0.2, finish_copy)
        timer.start()
        mgr.run_batch(batch(), True, zero_grad=True, optimizer=opt)
        timer.join()
        assert order == ["copied", "step"]
        assert mgr.before_step == [] and fence.pending == []
    finally:
        copied.set()
        fence.wait_for_snapshots()
        mgr.close()


def test_no_hook_without_a_pending_copy():
    mgr, _ = manager()
    fence.fence_steps(mgr.before_step)
    assert mgr.before_step == []
    mgr.close()
