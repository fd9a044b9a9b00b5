"""The per-replica routine: what each device does with its slice of a batch.

``device_share(job, d)`` is the one routine every path runs, one device or many, CPU replicas
or GPUs, ranks or not, buckets or not: zero (the first batch of an optimizer step), load the
slice, forward and loss (through the bound ``compute``, see ``fitdp.executor.replica``),
backward, metric update. The MXNet-style manager calls (``load_data_batch``, ``forward``,
``backward``, ``update_metric``) run its phases one at a time on every device
(``load_share``, ``forward_share``, ``backward_share``, ``metric_share``); ``run_batch`` runs
them all in one hand-off. ``device_task`` adds the device's shard of a sharded optimizer step.

Each slice's loss is weighted by its share of the batch (``weigh``): its valid rows over the
batch's (and the ranks') rows, or, for a loss that means over counted targets (an ignore
index), its count over the total (``count_targets``), so the summed gradients are the
whole-batch gradient.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fitdp.data.batch import DataBatch, batch_labels, take_rows
from fitdp.executor.replica import Compute, Executor, slice_count
from fitdp.executor.share_clock import ShareClock

if TYPE_CHECKING:
    from fitdp.executor.update import Update

# labels -> targets the loss means over; one with ``reads_inputs`` (``loss_items``) is called
# (inputs, labels)
Count = Callable[..., "torch.Tensor | None"]


class Job:
    """One batch's work, read by every device thread, set before the hand-off (kept until
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
        self.weights: list[Any] = [1.0] * n
        self.counts: list[Any] = [None] * n
        self.valid = [0] * n
        self.in_turn = False
        self.step_turns = False  # the compute takes the turns itself (``group._begin_turns``)
        self.timed = False  # record each share's time
        self.clock = ShareClock([ex.device for ex in executors])  # CUDA shares: by events
        self.batch: Any = None
        self.slices: list[slice] = []
        self.is_train, self.load, self.axis = False, True, 0
        self.compute: Compute | None = None
        self.autocast: torch.dtype | None = None
        self.scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.metric: Any = None
        self.metric_labels: Any = None  # labels given to ``update_metric`` (None: the batch's)
        self.update: Update | None = None
        self.clean: tuple[torch.Tensor, int] | None = None  # labels counted whole (all_counted)
        self.phases = PHASES  # or NAMED_PHASES, while a profiler records the call

    def set(self, batch: DataBatch, rows: int, axis: int, slices: list[slice]) -> None:
        """This batch, its rows, batch axis and slices; each device's valid rows."""
        self.batch, self.slices, self.axis, self.load = batch, slices, axis, True
        self.metric_labels = None
        if len(slices) == 1:
            self.valid[0] = rows - batch.pad
        else:
            end = rows - batch.pad
            for d, sl in enumerate(slices):
                self.valid[d] = max(0, min(sl.stop, end) - sl.start)

    def all_counted(self, labels: Any, counter: Count) -> bool:
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


# -- the per-replica routine ----------------------------------------------------------------

def load_share(job: Job, d: int) -> None:
    """Copy device ``d``'s slice of the batch into its input buffers."""
    ex, batch, sl = job.executors[d], job.batch, job.slices[d]
    if len(job.slices) == 1:
        ex.load(batch.data, batch.label, job.valid[0], batch.sample_weight, job.axis,
                sl.stop - sl.start)
    else:
        axis = job.axis
        ex.load(_rows(batch.data, sl, axis), _rows(batch.label, sl, axis), job.valid[d],
                None if batch.sample_weight is None else batch.sample_weight[sl], axis,
                sl.stop - sl.start)


def forward_share(job: Job, d: int) -> float:
    """Forward and loss on device ``d``; in turn (after device ``d - 1``'s forward) when the
    replicas share a generator and draw from it. Returns the seconds spent waiting."""
    ex = job.executors[d]
    if not job.in_turn:
        ex.forward(job.is_train, job.compute, job.weights[d], job.autocast, job.counts[d])
        return 0.0
    waited = 0.0
    try:
        if d:
            before = perf_counter()
            job.turn[d - 1].wait()
            waited = perf_counter() - before
        ex.forward(job.is_train, job.compute, job.weights[d], job.autocast, job.counts[d])
    finally:
        job.turn[d].set()  # also on failure: the next device never waits for ever
    return waited


def backward_share(job: Job, d: int) -> None:
    """Backward of device ``d``'s weighted loss (gradients add into its buckets)."""
    job.executors[d].backward(job.scale)


def metric_share(job: Job, d: int) -> None:
    """Device ``d``'s clone of ``job.metric`` (a ``DeviceMetrics``) updated with its valid
    outputs and labels, on its thread."""
    ex = job.executors[d]
    labels = ex.labels if job.metric_labels is None else take_rows(
        job.metric_labels, job.slices[d], ex.axis)
    outputs = ex.outputs
    if outputs.__class__ is dict and "logits" in outputs:  # a Hugging Face model's
        hf_labels = batch_labels(ex.inputs, labels)  # (in the batch dict, or y)
        if isinstance(hf_labels, torch.Tensor):
            outputs, labels = outputs["logits"], hf_labels
    if ex.valid > 0 and labels is not None:
        axes = ex.output_axes(outputs)
        job.metric.update(d, take_rows(outputs, slice(0, ex.valid), axes),
                          ex.valid_rows(labels), ex.valid_rows(ex.weights), axes)


def device_share(job: Job, d: int) -> None:
    """Device ``d``'s share of the batch: zero, load, forward, backward, metric; its time
    goes to ``job.times[d]`` (less the wait for an earlier device's turn)."""
    timed = job.timed
    if timed:
        start = perf_counter()
        job.clock.begin(d)
    waited = 0.0
    try:
        update = job.update
        if update is not None and update.zero:  # the first batch of an optimizer step
            update.zero_device(d)
        phases = job.phases
        if job.load:
            phases.load(job, d)
        waited = phases.forward(job, d)
    finally:
        if job.in_turn:
            job.turn[d].set()  # a load that failed never leaves the next device waiting
    if job.is_train:
        phases.backward(job, d)
    if job.metric is not None:
        phases.metric(job, d)
    if timed:
        job.clock.end(d)  # a CUDA share's device time: read later, no host sync
        end = perf_counter()
        job.times[d] = end - start - waited
        job.ends[d] = end


class Phases(NamedTuple):
    """The phases ``device_share`` runs, each ``phase(job, d)``: the plain functions, or
    the same in ``torch.profiler.record_function`` ranges (``NAMED_PHASES``)."""

    load: Callable[[Job, int], None]
    forward: Callable[[Job, int], float]
    backward: Callable[[Job, int], None]
    metric: Callable[[Job, int], None]


def named(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside a ``torch.profiler.record_function(name)`` range: a named span in
    a profiler's trace. (The range costs about a microsecond even with no profiler running,
    so only a call that a profiler records binds these; the others run ``fn`` itself.)"""
    @functools.wraps(fn)
    def ranged(*args: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args)

    return ranged


PHASES = Phases(load_share, forward_share, backward_share, metric_share)
NAMED_PHASES = Phases(*(named(f"fitdp.{name}", fn) for name, fn in zip(
    ("load", "forward", "backward", "metrics"), PHASES)))


def device_task(job: Job, d: int) -> None:
    """Device ``d``'s whole part of the batch, on its thread: its share, then its shard of a
    sharded optimizer step once every device has arrived."""
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


# -- each slice's loss weight -------------------------------------------------------------

def weigh(job: Job, total_rows: int | torch.Tensor, counter: Count | None,
          global_count: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Each device's loss weight (and count) into ``job``: its valid rows over
    ``total_rows``, or its share of the counted targets (see ``count_targets``)."""
    executors, weights, counts, valid = job.executors, job.weights, job.counts, job.valid
    if not isinstance(total_rows, torch.Tensor):
        denom_f = float(max(total_rows, 1))
        for d in range(len(weights)):
            weights[d], counts[d] = valid[d] / denom_f, None
    else:  # summed over ranks, on device 0: no host sync
        denom = total_rows.clamp(min=1)
        for d, ex in enumerate(executors):  # each device's weight on its own device
            weights[d] = (valid[d] / denom).to(ex.device, non_blocking=True)
            counts[d] = None
    if counter is None:
        return  # rows weigh the slices (one device, or a loss that means over rows)
    batch = job.batch
    # A ``loss_items`` count reads the slice's inputs too (a Hugging Face batch holds its
    # labels); a loss's own count reads the targets.
    items = getattr(counter, "reads_inputs", False)
    if (len(executors) == 1 and global_count is None) or (
            batch.sample_weight is not None) or (batch.label is None and not items):
        return  # sample weights mean over rows (Keras's sum_over_batch_size); no targets
    if global_count is None and all(ex.device.type == "cpu" for ex in executors):
        # From the batch's rows: no device needs its slice loaded first (counted on
        # device 0's thread during the hand-off, the few small ops queued for the GIL behind
        # the other threads': measured 115 us instead of 34 on the 128-wide MLP, two threads).
        if not items and job.all_counted(batch.label, counter):
            return  # no target ignored: each device's count is in proportion to its rows
        parts: list[tuple[Any, Any] | None] = []
        for sl, v in zip(job.slices, job.valid):
            rows = slice(sl.start, sl.start + v)
            parts.append((take_rows(batch.data, rows, job.axis) if items else None,
                          take_rows(batch.label, rows, job.axis)) if v else None)
    else:  # a collective over the ranks, or counts on the devices: from the loaded slices
        if job.load:
            for d in range(len(executors)):
                load_share(job, d)
            job.load = False
        parts = [(ex.valid_rows(ex.inputs) if items else None, ex.valid_rows(ex.labels))
                 if ex.valid and (items or ex.labels is not None) else None
                 for ex in executors]
    counted = count_targets(parts, [ex.device for ex in executors], counter, global_count)
    if counted is not None:
        per, total = counted
        for d, c in enumerate(per):
            counts[d], weights[d] = c, c / total.to(c.device, non_blocking=True)


def count_targets(parts: Sequence[tuple[Any, Any] | None], devices: Sequence[torch.device],
                  counter: Count, global_count: Callable[[torch.Tensor], torch.Tensor] | None
                  ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """Per device, what its slice's mean loss divides by, and their sum over devices (and
    ranks, ``global_count``): a loss with an ignore index (per-token labels padded with -100)
    means over the targets it does not ignore, and a module's own loss over the items of
    ``compile(loss_items=...)``, so weighing slices by rows would give another update than
    one device on the whole batch. ``parts`` holds each device's ``(inputs, labels)`` (None:
    no rows). None for a loss that means over rows."""
    counts = []
    for part, dev in zip(parts, devices):
        c = None if part is None else slice_count(counter, *part)
        if c is None and part is not None:
            return None  # the loss means over rows after all
        counts.append(torch.zeros((), device=dev) if c is None else c.float().to(dev))
    total = torch.stack([c.to(devices[0], non_blocking=True) for c in counts]).sum()
    if global_count is not None:
        total = global_count(total)
    return counts, total.clamp(min=1)


def _rows(tree: Any, sl: slice, axis: int) -> Any:
    """``take_rows`` without its tree walk for one batch-first tensor (every device, every
    step); None stays None."""
    if axis == 0 and tree.__class__ is torch.Tensor:
        return tree[sl]
    return None if tree is None else take_rows(tree, sl, axis)
