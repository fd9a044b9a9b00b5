"""The step of a call, bound once (``Step``), and the routine each device runs on its slice.

Like Keras's ``make_train_function``, ``DataParallelExecutorManager.bind_step`` builds one
``Step`` from what a call fixes: training or not, the ``Update`` (optimizer, scaler,
clipping; none in evaluation), the loss scale, the metric, named ranges for a profiler, and
``work_load_list="auto"`` (``Balancing``, bound only then). Per batch it is told only what
changes per batch: the batch, whether it zeroes the gradients first (the first batch of an
optimizer step), whether it ends with the step, and its rows.

``device_share(job, d)`` is the one routine every device runs, one device or many, CPU or
GPU, ranks or not, buckets or not: zero (the first batch of an optimizer step), load the
slice, forward and loss (through the bound ``compute``, see ``fitdp.executor.replica``),
backward, metric update. A batch is one hand-off of it to every device (the device threads
of ``DeviceWorkers``, at the end of this module); the optimizer step (``Update.apply``)
follows on the caller. The MXNet-style manager calls (``load_data_batch``, ``forward``,
``backward``, ``update_metric``) run one of its phases on every device (``Step.phase``).
What each slice's loss weighs is decided by ``fitdp.executor.weighing``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from fitdp.data.batch import DataBatch, batch_labels, checked_rows, take_rows
from fitdp.executor.engine import Engine
from fitdp.executor.replica import Compute, Executor
from fitdp.executor.update import Update
from fitdp.executor.weighing import Weighing

Scale = Callable[[torch.Tensor], torch.Tensor]


class Job:
    """One batch's work on one group's executors, read by every device thread, set before
    the hand-off (kept until the next: the executors hold the batch's inputs anyway).

    Example:
        >>> job = Job([Executor(torch.nn.Linear(2, 1), torch.device("cpu"), {})])
        >>> job.valid
        [0]
    """

    def __init__(self, executors: Sequence[Executor]) -> None:
        n = len(executors)
        self.executors = list(executors)
        self.turn = [threading.Event() for _ in range(n)]  # forwards in device order
        self.weights: list[Any] = [1.0] * n
        self.counts: list[Any] = [None] * n
        self.valid = [0] * n
        self.in_turn = False
        self.step_turns = False  # the compute takes the turns itself (``group.begin_turns``)
        self.batch: Any = None
        self.slices: list[slice] = []
        self.load, self.axis = True, 0
        self.step: Step | None = None  # the bound step this batch runs
        self.metric_labels: Any = None  # labels given to ``update_metric`` (None: the batch's)
        self.update: Update | None = None  # the update that zeroes first, or None
        self.phases = ALL  # what ``device_share`` runs (one phase: an MXNet-style call)

    def set(self, batch: DataBatch, rows: int, axis: int, slices: list[slice]) -> None:
        """This batch, its rows, batch axis and slices; each device's valid rows."""
        self.batch, self.slices, self.axis, self.load = batch, slices, axis, True
        self.metric_labels = None
        end = rows - batch.pad
        for d, sl in enumerate(slices):
            self.valid[d] = max(0, min(sl.stop, end) - sl.start)

    def load_all(self) -> None:
        """Every device's slice loaded now, on this thread (counts read the slices), by the
        job's step."""
        if self.load:
            phases, update = self.phases, self.update
            self.phases, self.update = LOAD, None
            try:
                for d in range(len(self.executors)):
                    device_share(self, d)
            finally:
                self.phases, self.update = phases, update
            self.load = False


# -- the per-replica routine ----------------------------------------------------------------

class Phases(NamedTuple):
    """Which phases ``device_share`` runs: every one for a bound step's batch (``ALL``), one
    for each MXNet-style call of the manager (``load_data_batch``, ``forward``, ...)."""

    load: bool = False
    forward: bool = False
    backward: bool = False
    metric: bool = False


ALL = Phases(True, True, True, True)
LOAD = Phases(load=True)


class Ranges(NamedTuple):
    """The contexts one device's phases run in: nothing (``PLAIN``), or named ranges in a
    profiler's trace (``named_ranges``: bound only for a call that a profiler records)."""

    load: contextlib.AbstractContextManager[Any]
    forward: contextlib.AbstractContextManager[Any]
    backward: contextlib.AbstractContextManager[Any]
    metric: contextlib.AbstractContextManager[Any]


_NULL = contextlib.nullcontext()  # reusable: entering it has no state
PLAIN = Ranges(_NULL, _NULL, _NULL, _NULL)


def named_ranges() -> Ranges:
    """``torch.profiler.record_function`` ranges ``fitdp.load``, ``fitdp.forward``,
    ``fitdp.backward``, ``fitdp.metrics`` for one device (a range object is entered by one
    thread at a time: one set per device)."""
    return Ranges(*(torch.profiler.record_function(f"fitdp.{name}")
                    for name in ("load", "forward", "backward", "metrics")))


def device_share(job: Job, d: int) -> None:
    """Device ``d``'s share of the batch, the phases of ``job.phases`` in order: zero (the
    first batch of an optimizer step), load its slice, forward and loss (in turn, after
    device ``d - 1``'s forward, when the replicas share a generator and draw from it),
    backward of the weighted loss (gradients add into its buckets), and the update of its
    clone of the step's metric (a ``DeviceMetrics``) with its valid outputs and labels."""
    step: Step = job.step  # type: ignore[assignment]
    ex = job.executors[d]
    ranges = step.ranges[d]
    phases = job.phases
    try:
        update = job.update
        if update is not None:
            update.zero_device(d)
        if phases.load and job.load:  # this device's slice into its input buffers
            with ranges.load:
                batch, sl, axis = job.batch, job.slices[d], job.axis
                data, label, weight = batch.data, batch.label, batch.sample_weight
                if len(job.slices) > 1:
                    data = take_rows(data, sl, axis)
                    label = None if label is None else take_rows(label, sl, axis)
                    weight = None if weight is None else weight[sl]  # one per row
                ex.load(data, label, job.valid[d], weight, axis, sl.stop - sl.start)
        if phases.forward:
            with ranges.forward:
                if job.in_turn and d:
                    job.turn[d - 1].wait()
                ex.forward(step.is_train, step.compute, job.weights[d], step.autocast,
                           job.counts[d])
    finally:
        if job.in_turn:
            job.turn[d].set()  # also on failure: the next device never waits for ever
    if phases.backward and step.is_train:
        if not step.keep_outputs:  # freed before backward, as a hand loop's outputs are
            ex.outputs = None
        with ranges.backward:
            ex.backward(step.scale)
    metric = step.metric
    if phases.metric and metric is not None:
        with ranges.metric:
            labels = ex.labels if job.metric_labels is None else take_rows(
                job.metric_labels, job.slices[d], ex.axis)
            outputs = ex.outputs
            if isinstance(outputs, dict) and "logits" in outputs:  # a Hugging Face model's
                hf_labels = batch_labels(ex.inputs, labels)  # (in the batch dict, or y)
                if isinstance(hf_labels, torch.Tensor):
                    outputs, labels = outputs["logits"], hf_labels
            if ex.valid > 0 and labels is not None:
                axes, weights = ex.output_axes(outputs) if ex.axis else 0, ex.weights
                if ex.valid < ex.rows:  # padding rows stay out of the metric
                    outputs = take_rows(outputs, slice(0, ex.valid), axes)
                    labels, weights = ex.valid_rows(labels), ex.valid_rows(weights)
                metric.update(d, outputs, labels, weights, axes)


# -- the bound step ---------------------------------------------------------------------------

class Group(Protocol):
    """What a step reads of an executor group (``fitdp.executor.group``, which runs this
    module's routine: named here by what it does, not imported)."""

    @property
    def job(self) -> Job: ...

    @property
    def shares(self) -> Sequence[Callable[[], None]]: ...

    @property
    def executors(self) -> Sequence[Executor]: ...

    @property
    def workers(self) -> DeviceWorkers: ...

    stochastic: bool | None  # do the replicas draw random numbers in training?
    bucketed: bool  # its executors share input buffers with other groups'

    def begin_turns(self, is_train: bool) -> list[torch.Tensor] | None: ...

    def end_turns(self, before: list[torch.Tensor] | None) -> None: ...

    def warn_grown(self) -> None: ...

    def set_mode(self, is_train: bool) -> None: ...


class Timing(Protocol):
    """A hand-off whose shares are timed (``fitdp.executor.balance.Balancing``)."""

    def tasks(self, job: Job) -> Sequence[Callable[[], None]]: ...

    def decide(self, job: Job) -> tuple[list[float], list[float]] | None: ...


class Manager(Protocol):
    """What a step reads of its manager (``DataParallelExecutorManager``)."""

    compute: Compute
    autocast_dtype: torch.dtype | None
    distributed: bool
    loss: Any
    bucket_module: Any
    engine: Engine
    devices: list[torch.device]

    row_slices: dict[int, list[slice]]  # rows of a batch -> each device's, once seen

    @property
    def execgrp(self) -> Group: ...

    def group_of(self, data_batch: DataBatch, checked: bool = False) -> Group: ...

    def slices_for(self, rows: int) -> list[slice]: ...

    def use_loads(self, loads: list[float], seconds: Sequence[float] | None) -> None: ...

    def weighing(self) -> Weighing: ...


class Step:
    """One call's step, bound once (see the module docstring).

    Args:
        mgr: the manager whose replicas it runs.
        is_train: train (backward, and the update's zeroing and step) or only forward.
        update: the training update (None: evaluation).
        scale: multiplies each loss before backward (a ``GradScaler``'s ``scale``), or None.
        metric: a ``DeviceMetrics`` each device updates with its slice, or None.
        named: run the phases in named ranges for a profiler (``named_ranges``).
        balancing: ``work_load_list="auto"``'s timing of each share, or None.
    """

    def __init__(self, mgr: Manager, is_train: bool, update: Update | None,
                 scale: Scale | None, metric: Any, named: bool = False,
                 balancing: Timing | None = None) -> None:
        self.mgr = mgr
        self.is_train, self.update = is_train, update
        self.scale, self.metric = scale, metric
        # Per device, what its phases run in (``Ranges``).
        self.ranges = [named_ranges() if named else PLAIN for _ in mgr.devices]
        self.compute: Compute = mgr.compute
        self.autocast = mgr.autocast_dtype
        self.weighing: Weighing = mgr.weighing()
        # Ranks' batches may differ in size: the rows of a step are summed over the ranks.
        self.rows_over_ranks = mgr.distributed and is_train and mgr.loss is not None
        # Told whether each training batch steps (DDP reduces in backward on that batch).
        self.engine: Engine | None = mgr.engine if is_train and mgr.engine.prepares else None
        self.row_slices = mgr.row_slices  # (emptied in place when the work loads change)
        self.balancing = balancing
        # The one group, without buckets; with them, the batch's (made on first sight).
        self.group = mgr.execgrp if mgr.bucket_module is None else None
        self.samples = 0  # rows run so far, padding left out (a call's throughput reads it)
        # A training step's outputs outlive backward only for a reader: its metric, the
        # call's first-batch checks, or an MXNet-style caller's get_outputs (the default).
        # Held, a causal LM's logits (GPT-2 124M, batch 4x128: 103 MB) stay through backward
        # and into the next forward: +0.33 GB peak RSS over the hand loop (bench/hf_sizes.py).
        self.keep_outputs = True

    def __call__(self, batch: DataBatch, *, zero_grad: bool = False, step: bool = False,
                 total_rows: int | torch.Tensor | None = None) -> None:
        """Load, forward, backward (training), metrics and, with ``step``, the optimizer
        update of ``batch``; ``zero_grad``: zero the gradients first; ``total_rows``: the
        rows the mean loss is taken over (default: this batch's, summed over the ranks)."""
        rows, axis = checked_rows(batch)
        self.samples += rows - batch.pad
        if self.metric is not None:  # time-major outputs reach it batch-first
            self.metric.axis = axis
        mgr = self.mgr
        group = self.group
        if group is None:  # buckets: the batch's group, in this step's mode (made mid-call,
            group = mgr.group_of(batch, checked=True)  # or run last in the other mode)
            group.set_mode(self.is_train)
        job = group.job
        job.set(batch, rows, axis, self.row_slices.get(rows) or mgr.slices_for(rows))
        update = self.update
        stepping = step and update is not None and update.optimizer is not None
        balancing = self.balancing
        job.step = self
        try:
            self.weighing.weigh(job, total_rows, self.rows_over_ranks)
            if self.engine is not None:
                self.engine.prepare(stepping)
            job.update = update if zero_grad else None
            # The hand-off: the shares on the device threads at once, forwards in turn
            # where the replicas share a generator and draw from it.
            if self.is_train and group.stochastic is not False:
                probe = group.begin_turns(True)
            else:  # no turns (evaluation, or replicas that never draw)
                probe = None
                job.in_turn = job.step_turns = False
            group.workers.run(group.shares if balancing is None else balancing.tasks(job))
            if probe is not None:
                group.end_turns(probe)
        finally:
            job.step = None  # the group holds no step (nor, through it, its manager)
        if self.metric is not None and self.metric.whole:  # updated with the whole batch
            self.metric.end_batch(axis)
        if group.bucketed:
            group.warn_grown()
        if balancing is not None:
            loads = balancing.decide(job)
            if loads is not None:
                mgr.use_loads(*loads)
        if stepping:
            update.apply()  # type: ignore[union-attr]

    def phase(self, group: Group, phases: Phases) -> None:
        """Some phases of the routine on every device at once (the MXNet-style calls)."""
        job = group.job
        job.step, job.update, job.phases = self, None, phases
        try:
            group.workers.run(group.shares)
        finally:
            job.step, job.phases = None, ALL

    def step_now(self) -> None:
        """The optimizer step alone, from the gradients of the batches run so far."""
        update = self.update
        if update is not None and update.optimizer is not None:
            update.apply()


# -- the device threads ------------------------------------------------------------------------
# One worker thread per device, so replicas run at once (PyTorch ops release the GIL). The
# current CUDA device, the current stream and the autocast state are per thread: a worker
# enters its device, the caller's current stream on that device and the caller's autocast
# state for each task, as ``torch/nn/parallel/parallel_apply.py`` does, so code that reads
# the current device or stream (``device="cuda"`` in a module,
# ``torch.cuda.current_stream()``) lands on the replica's device and is ordered against the
# caller's stream.

_STOP = object()  # a worker's task that ends its thread


class _Slot:
    """One worker's hand-off: the task, its outcome, and two locks used as signals.

    A step's hand-off is a lock release each way (``go``, then ``done``) instead of a Future
    and a queue per task: a round trip is mostly the OS waking a thread, and the Future's
    condition variable added Python to it (measured, two no-op tasks per round: 49.7 us
    against 51.5).
    """

    __slots__ = ("go", "done", "task", "result", "error")

    def __init__(self) -> None:
        self.go = threading.Lock()
        self.done = threading.Lock()
        self.go.acquire()  # held while the worker has nothing to do
        self.done.acquire()  # held until the task ends
        self.task: Any = None
        self.result: Any = None
        self.error: BaseException | None = None


class DeviceWorkers:
    """Runs one task per device concurrently: task 0 on the caller, task d on worker thread d.

    Workers are persistent (started once, reused every step), because starting threads per
    step would cost more than a small model's whole step. They stop on ``close()`` or when
    this object is garbage-collected (the threads hold only their slots, never this object).

    Args:
        devices: the devices (or how many CPU devices); task d runs with device d current.

    Example:
        >>> w = DeviceWorkers(2)
        >>> w.run([lambda: 1, lambda: 2])
        [1, 2]
        >>> w.close()
    """

    def __init__(self, devices: int | Sequence[torch.device]) -> None:
        if isinstance(devices, int):
            devices = [torch.device("cpu")] * devices
        self.devices = list(devices)
        num_devices = len(self.devices)
        self._cuda = any(d.type == "cuda" for d in self.devices)
        self._slots: list[_Slot] = []
        self._threads: list[threading.Thread] = []
        for d in range(1, num_devices):
            slot = _Slot()
            t = threading.Thread(target=_serve, args=(slot,), name=f"fitdp-device-{d}",
                                 daemon=True)
            t.start()
            self._slots.append(slot)
            self._threads.append(t)
        self._finalizer = weakref.finalize(self, _stop, self._slots, self._threads, 0.0)

    @property
    def alive(self) -> int:
        """Worker threads still running (0 after ``close``)."""
        return sum(t.is_alive() for t in self._threads)

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[d]`` for every device d at once; return their results in order.

        Every task has finished before this returns or raises, whatever happens: the first
        exception by device order is raised after all of them end, and a KeyboardInterrupt
        that arrives while waiting is raised only once every worker is done, so no worker is
        ever left running on state the caller is about to roll back.
        """
        if len(tasks) == 1 and not self._cuda:
            return [tasks[0]()]  # on the caller, in its own context already
        if self._cuda or torch.is_autocast_enabled("cpu"):  # (CPU without autocast: as they are)
            tasks = self._in_context(tasks)
        if len(tasks) == 1:
            return [tasks[0]()]
        slots = self._slots
        for slot, task in zip(slots, tasks[1:]):
            slot.task = task
            slot.go.release()
        results: list[Any] = [None]
        errors: list[BaseException | None] = [None]
        try:
            results[0] = tasks[0]()
        except BaseException as err:  # noqa: BLE001 - raised below, after the others finish
            errors[0] = err
        interrupted: BaseException | None = None
        for slot in slots[: len(tasks) - 1]:
            while True:
                try:
                    slot.done.acquire()
                    break
                except KeyboardInterrupt as err:  # keep waiting: raise once all are done
                    interrupted = interrupted or err
            results.append(slot.result)
            errors.append(slot.error)
            slot.result = slot.error = None  # hold no step's tensors while idle
        if interrupted is not None:
            raise interrupted
        for error in errors:
            if error is not None:
                raise error
        return results

    def _in_context(self, tasks: Sequence[Callable[[], Any]]) -> Sequence[Callable[[], Any]]:
        """``tasks``, each entering its device, stream and the caller's autocast state (the
        caller has one to carry: CUDA devices or CPU autocast)."""
        cpu_autocast = torch.is_autocast_enabled("cpu")
        cuda_autocast = self._cuda and torch.is_autocast_enabled("cuda")
        states = {kind: torch.get_autocast_dtype(kind) for kind, on in
                  (("cpu", cpu_autocast), ("cuda", cuda_autocast)) if on}
        streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None
                   for d in self.devices]
        return [functools.partial(_entered, task, self.devices[d], streams[d], states)
                for d, task in enumerate(tasks)]

    def close(self) -> None:
        """Stop the worker threads and wait for them (idempotent)."""
        if self._finalizer.detach() is not None:
            _stop(self._slots, self._threads)


def _entered(task: Callable[[], Any], device: torch.device, stream: Any,
             autocast: dict[str, torch.dtype]) -> Any:
    with _context(device, stream, autocast):
        return task()


@contextlib.contextmanager
def _context(device: torch.device, stream: Any, autocast: dict[str, torch.dtype]
             ) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if stream is not None:
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        for kind, dtype in autocast.items():
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        yield


def _stop(slots: list[_Slot], threads: list[threading.Thread], timeout: float = 10.0) -> None:
    for slot in slots:
        slot.task = _STOP
        slot.go.release()
    if timeout:
        for t in threads:
            t.join(timeout=timeout)


def _serve(slot: _Slot) -> None:
    while True:
        slot.go.acquire()
        task, slot.task = slot.task, None
        if task is _STOP:
            return
        try:
            slot.result = task()
        except BaseException as err:  # noqa: BLE001 - handed to the caller through the slot
            slot.error = err
        del task  # drop the reference to the step's tensors while idle
        slot.done.release()
