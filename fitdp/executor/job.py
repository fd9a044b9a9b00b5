"""One batch's work on every device (``DataParallelExecutorGroup.run``): what each device
thread runs in the batch's one hand-off."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import torch

from fitdp.data.batch import DataBatch, take_rows
from fitdp.executor.executor import Executor, LossFn
from fitdp.executor.fused import FusedUpdate


class Job:
    """One ``run``'s work, read by every device thread, set before the hand-off (kept until
    the next: the executors hold the batch's inputs anyway). Holds the executors, never
    their group.

    Example:
        >>> job = Job([Executor(torch.nn.Linear(2, 1), torch.device("cpu"), {})])
        >>> job.times
        [0.0]
    """

    def __init__(self, executors: Sequence[Executor]) -> None:
        n = len(executors)
        self.executors = list(executors)
        self.turn = [threading.Event() for _ in range(n)]  # forwards in device order
        self.times = [0.0] * n  # each device's seconds on its share of the last batch
        self.ends = [0.0] * n  # when each device's share ended (``perf_counter``)
        self.weights: list[Any] = [None] * n
        self.counts: list[Any] = [None] * n
        self.valid = [0] * n
        self.in_turn = False
        self.timed = False  # record each share's time
        self.batch: Any = None
        self.slices: list[slice] = []
        self.is_train, self.load, self.axis = False, True, 0
        self.loss_fn: LossFn | None = None
        self.autocast: torch.dtype | None = None
        self.scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.metric: Any = None
        self.update: FusedUpdate | None = None
        self.clean: tuple[torch.Tensor, int] | None = None  # labels counted whole (all_counted)

    def all_counted(self, labels: Any, counter: Callable[[Any], torch.Tensor | None]) -> bool:
        """Whether ``counter`` counts every target of ``labels``: an integer count (an
        unweighted loss) of all of them means none is ignored, so each device's count is its
        rows times the targets per row and the row weights are exact (ordinary labels).

        The count is of the tensor the labels are a view of (an in-memory source's labels
        for the epoch), once while it is unchanged (its version counter): no op per batch.
        On the CPU, reading the count is no device sync."""
        if not isinstance(labels, torch.Tensor):
            return False
        base = labels if labels._base is None else labels._base
        if self.clean is not None and self.clean[0] is base and self.clean[1] == base._version:
            return True
        whole = counter(base)
        if whole is None or whole.is_floating_point() or int(whole) != base.numel():
            return False
        self.clean = (base, base._version)
        return True

    def set(self, batch: DataBatch, rows: int, axis: int, slices: list[slice], is_train: bool,
            loss_fn: LossFn | None, autocast: torch.dtype | None,
            scale: Callable[[torch.Tensor], torch.Tensor] | None, metric: Any,
            update: FusedUpdate | None) -> None:
        self.batch, self.slices, self.is_train, self.loss_fn = batch, slices, is_train, loss_fn
        self.autocast, self.scale, self.metric, self.update = autocast, scale, metric, update
        self.axis, self.load = axis, True
        end = rows - batch.pad
        if len(slices) == 1:
            self.valid[0] = end
        else:
            for d, sl in enumerate(slices):
                self.valid[d] = max(0, min(sl.stop, end) - sl.start)



def device_task(job: Job, d: int) -> None:
    """Device ``d``'s whole part of the batch, on its thread: its share, then (with an
    optimizer update) its part of the update once every device has arrived."""
    update = job.update
    ok = False
    try:
        device_share(job, d)
        ok = True
    finally:
        if update is not None:
            update.arrive(d, ok)  # also on failure: no thread waits for ever
    if update is not None:
        update.finish(d)


def device_share(job: Job, d: int) -> None:
    """Device ``d``'s share of the batch: zero, load, forward, backward, metric; its time
    goes to ``job.times[d]`` (waits for the turn of an earlier device left out)."""
    ex = job.executors[d]
    timed = job.timed
    start = perf_counter() if timed else 0.0
    update = job.update
    if update is not None:
        update.before(d)
    if job.load:
        batch = job.batch
        if len(job.executors) == 1:
            ex.load(batch.data, batch.label, job.valid[0], batch.sample_weight, job.axis)
        else:
            sl, axis = job.slices[d], job.axis
            ex.load(_rows(batch.data, sl, axis), _rows(batch.label, sl, axis), job.valid[d],
                    None if batch.sample_weight is None else batch.sample_weight[sl], axis)
    waited = 0.0
    if job.in_turn:
        if d and timed:
            before = perf_counter()
            job.turn[d - 1].wait()
            waited = perf_counter() - before
        elif d:
            job.turn[d - 1].wait()
        try:
            ex.forward(job.is_train, job.loss_fn, job.weights[d], job.autocast, job.counts[d])
        finally:
            job.turn[d].set()  # also on failure: the next device never waits for ever
    else:
        ex.forward(job.is_train, job.loss_fn, job.weights[d], job.autocast, job.counts[d])
    if job.is_train:
        ex.backward(job.scale)
    metric = job.metric
    if metric is not None and ex.valid > 0:
        metric.update(d, ex.valid_rows(ex.outputs), ex.valid_rows(ex.labels),
                      ex.valid_rows(ex.weights))
    if timed:
        if ex.device.type == "cuda":
            torch.cuda.synchronize(ex.device)  # the share's device time (measuring only)
        end = perf_counter()
        job.times[d] = end - start - waited
        job.ends[d] = end




def count_all(job: Job, counter: Callable[[Any], torch.Tensor | None]) -> bool:
    """Every device's count of the targets its loss means over, and the weights they give,
    into ``job`` (``DataParallelExecutorGroup._counts`` from the batch's label rows: no
    device needs its slice loaded first). False when the loss means over rows after all.

    Done before the hand-off: counted on device 0's thread during it, the few small ops
    queued for the GIL behind the other threads' (measured: 115 us instead of 34 on the
    128-wide MLP, two threads)."""
    batch = job.batch
    if batch.label is None:
        return False
    if job.all_counted(batch.label, counter):
        return True  # no target ignored: each device's count is in proportion to its rows
    counts: list[torch.Tensor] = []
    for ex, sl, valid in zip(job.executors, job.slices, job.valid):
        if batch.label is None or not valid:
            counts.append(torch.zeros((), device=ex.device))
            continue
        c = counter(take_rows(batch.label, slice(sl.start, sl.start + valid), job.axis))
        if c is None:
            return False
        counts.append(c.float())
    total = torch.stack(counts).sum().clamp(min=1)
    for d, c in enumerate(counts):
        job.counts[d], job.weights[d] = c, c / total
    return True


def _rows(tree: Any, sl: slice, axis: int) -> Any:
    """``take_rows`` without its tree walk for one batch-first tensor (every device, every
    step); None stays None."""
    if axis == 0 and tree.__class__ is torch.Tensor:
        return tree[sl]
    return None if tree is None else take_rows(tree, sl, axis)
