"""One bucket's executors across devices (MXNet's ``DataParallelExecutorGroup``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from time import perf_counter
from typing import Any

import torch
from torch import nn

from fitdp.data.batch import DataBatch, take_rows
from fitdp.executor.executor import Executor, LossFn
from fitdp.executor.fused import FusedUpdate
from fitdp.executor.job import Job, count_all, device_share, device_task
from fitdp.executor.workers import DeviceWorkers

# Layers that draw from the generator in training: their CPU replicas run forward in turn.
_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout, nn.RReLU)


class DataParallelExecutorGroup:
    """The executors of one bucket, one per device, run concurrently by ``workers``.

    Args:
        modules: one replica per device (already on it).
        devices: the devices, in order.
        shared_buffers: per device, the input buffers shared with the other buckets.
        workers: the manager's device threads.
        bucket_key: the bucket this group runs (None without bucketing).
        compile: ``torch.compile`` each replica (one graph per input shape).
        logger: where the bucketing re-allocation warning goes (default: ``fitdp``).
        inputs_need_grad: track gradients of the inputs (``get_input_grads``).

    Example:
        >>> g = DataParallelExecutorGroup([nn.Linear(3, 1)], [torch.device("cpu")], [{}],
        ...                               DeviceWorkers(1))
        >>> g.param_names
        ['weight', 'bias']
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        devices: Sequence[torch.device],
        shared_buffers: Sequence[dict[str, tuple[torch.Tensor, tuple[int, ...]]]],
        workers: DeviceWorkers,
        *,
        bucket_key: Hashable | None = None,
        compile: bool | str = False,
        logger: logging.Logger | None = None,
        inputs_need_grad: bool = False,
    ) -> None:
        self.bucket_key = bucket_key
        self.workers = workers
        self.logger = logger or logging.getLogger("fitdp")
        self.executors = [
            Executor(m, d, b, compile=compile, warn_on_grow=bucket_key is not None,
                     inputs_need_grad=inputs_need_grad)
            for m, d, b in zip(modules, devices, shared_buffers)
        ]
        named = [dict(m.named_parameters()) for m in modules]
        # Every parameter, frozen ones too: they are replicated, averaged and saved like
        # buffers; only the trainable ones get gradients and optimizer steps.
        self.param_names = list(named[0])
        self.param_arrays: list[list[nn.Parameter]] = [
            [params[n] for params in named] for n in self.param_names
        ]
        self.stochastic: bool | None = None  # does a training forward draw random numbers?
        buffers = [dict(m.named_buffers()) for m in modules]
        self.aux_names = list(buffers[0])
        self.aux_arrays = [[b[n] for b in buffers] for n in self.aux_names]
        self.slices: list[slice] = []
        n = len(self.executors)
        # ``run``: this batch's work, set before the hand-off; the tasks are made once.
        # ``run``: this batch's work, read by the device threads; the tasks are made once
        # (and hold the job, never the group: a dropped model frees its threads at once).
        self._job = Job(self.executors)
        self._tasks = [functools.partial(device_task, self._job, d) for d in range(n)]
        self._shares = [functools.partial(device_share, self._job, d) for d in range(n)]
        self.times = self._job.times  # each device's seconds on its share of the last run
        self._cpu = all(ex.device.type == "cpu" for ex in self.executors)
        self.start = 0.0  # when the last ``run`` handed its batch off

    @property
    def grad_arrays(self) -> list[list[torch.Tensor | None]]:
        return [[p.grad for p in row] for row in self.param_arrays]

    def _run(self, fn: Callable[[Executor], Any]) -> list[Any]:
        return self.workers.run([functools.partial(fn, ex) for ex in self.executors])

    def load_data_batch(self, batch: DataBatch, slices: list[slice]) -> None:
        """Copy each device's slice of ``batch`` into its input buffers."""
        self.slices = slices
        valid_end = batch.batch_size - batch.pad
        axis = batch.axis
        if len(slices) == 1:
            self.executors[0].load(batch.data, batch.label, valid_end, batch.sample_weight,
                                   axis)
            self._warn_grown()
            return
        for ex, sl in zip(self.executors, slices):
            valid = max(0, min(sl.stop, valid_end) - sl.start)
            label = None if batch.label is None else take_rows(batch.label, sl, axis)
            weight = None if batch.sample_weight is None else batch.sample_weight[sl]
            ex.load(take_rows(batch.data, sl, axis), label, valid, weight, axis)
        self._warn_grown()

    def _warn_grown(self) -> None:
        """The seed's re-allocation warning, once per input name for all devices."""
        grown: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for ex in self.executors:
            for name, shape, allocated in ex.grown:
                grown.setdefault(name, (shape, allocated))
            ex.grown.clear()
        for name, (shape, allocated) in grown.items():
            self.logger.warning(
                'bucketing: data "%s" has a shape %s, which is larger than already allocated '
                "shape %s. Need to re-allocate. Consider putting default_bucket_key to be "
                "the bucket taking the largest input for better memory sharing.",
                name, shape, allocated,
            )

    def forward(
        self,
        is_train: bool,
        loss_fn: LossFn | None,
        total_rows: int | torch.Tensor,
        autocast_dtype: torch.dtype | None,
        global_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Run every replica on its slice; each loss is weighted by ``valid / total_rows``, or
        by its share of the counted targets (see ``_counts``; ``global_count`` sums a count
        over ranks)."""
        # Read the mode rather than cache it: with one device the replica is the user's module,
        # which the user may switch between calls (train() walks every submodule: only then).
        for ex in self.executors:
            if ex.module.training is not is_train:
                ex.module.train(is_train)
        counted = self._counts(loss_fn, global_count)
        counts: list[Any] = [None] * len(self.executors)
        if counted is None:
            denom = total_rows.clamp(min=1) if isinstance(total_rows, torch.Tensor) else float(
                max(total_rows, 1))
            weights: list[Any] = [ex.valid / denom for ex in self.executors]
        else:
            counts, total = counted
            weights = [c / total.to(c.device, non_blocking=True) for c in counts]

        def task(ex: Executor, d: int) -> None:
            ex.forward(is_train, loss_fn, weights[d], autocast_dtype, counts[d])

        if is_train and self._draws_in_turn():
            before = self._rng_states() if self.stochastic is None else None
            for d, ex in enumerate(self.executors):
                task(ex, d)
            if before is not None:  # the probe: did that forward draw random numbers?
                after = self._rng_states()
                self.stochastic = any(not torch.equal(a, b) for a, b in zip(before, after))
        else:
            self.workers.run([functools.partial(task, ex, d)
                              for d, ex in enumerate(self.executors)])

    def run(
        self,
        batch: DataBatch,
        rows: int,
        axis: int,
        slices: list[slice],
        is_train: bool,
        loss_fn: LossFn | None,
        total_rows: int | torch.Tensor,
        autocast_dtype: torch.dtype | None,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        metric: Any = None,
        update: FusedUpdate | None = None,
        global_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
        serial: bool = False,
        timed: bool = False,
    ) -> None:
        """Load, forward, backward (``is_train``) and update ``metric`` (a ``DeviceMetrics``)
        for every device in one hand-off (``rows``, ``axis``: the batch's, checked): each
        device thread loads its own slice and does all of its work, and with ``update`` also
        zeroes its gradients first and takes its part of the optimizer update last. Same
        numbers as ``load_data_batch``, ``forward``, ``backward`` and ``update_metric`` in
        turn. ``serial``: run every device's share on this thread, one after another (what
        one replica's thread would do). ``timed``: record each share's time (``times``,
        ``section_seconds``); untimed, a share reads no clock."""
        for ex in self.executors:  # read, not cached: see ``forward``
            if ex.module.training is not is_train:
                ex.module.train(is_train)
        job, n = self._job, len(self.executors)
        job.set(batch, rows, axis, slices, is_train, loss_fn, autocast_dtype, scale, metric,
                update)
        job.timed = timed
        self.slices = slices
        weights, counts = job.weights, job.counts
        denom = total_rows.clamp(min=1) if isinstance(total_rows, torch.Tensor) else float(
            max(total_rows, 1))
        for d in range(n):
            weights[d], counts[d] = job.valid[d] / denom, None
        counter = getattr(loss_fn, "counts", None) if n > 1 else None
        if counter is not None and batch.sample_weight is None:
            if global_count is None and self._cpu:
                count_all(job, counter)  # per-token weights, from the batch's labels
            else:  # a collective over the ranks, or counts on the devices: as ``forward``
                self.load_data_batch(batch, slices)
                job.load = False
                counted = self._counts(loss_fn, global_count)
                if counted is not None:
                    per, total = counted
                    for d in range(n):
                        weights[d] = per[d] / total.to(per[d].device, non_blocking=True)
                        counts[d] = per[d]
        job.in_turn = is_train and self.stochastic is not False and self._draws_in_turn()
        probe = job.in_turn and self.stochastic is None
        before = torch.get_rng_state() if probe else None
        if job.in_turn:
            for event in job.turn:
                event.clear()
        if timed:
            self.start = perf_counter()
        if serial or n == 1:
            for d in range(n):
                device_share(job, d)
            if update is not None:
                update.finish_all()
        elif update is None or update.optimizer is None or update.shards == 1:
            # No update, or device 0's alone: after the shares, here (the hand-off's own
            # wait is the barrier; no event per device).
            self.workers.run(self._shares)
            if update is not None:
                update.finish_all()
        else:
            self.workers.run(self._tasks)
        if before is not None:  # the probe: did that forward draw random numbers?
            self.stochastic = not torch.equal(before, torch.get_rng_state())
        if metric is not None:
            metric.end_batch(axis)  # the metrics that update with the whole batch
        if self.executors[0].warn_on_grow:
            self._warn_grown()

    def section_seconds(self, serial: bool) -> float:
        """The last ``run``'s time on the devices' shares: from the hand-off until the last
        share ended, or (``serial``) the sum of the shares' own times."""
        return sum(self.times) if serial else max(self._job.ends) - self.start

    def _counts(self, loss_fn: LossFn | None, global_count: Callable[[torch.Tensor],
                torch.Tensor] | None) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """Per device, what its slice's mean loss divides by, and their sum over devices
        (and ranks), when that is not the rows: a loss with an ignore index (per-token
        labels padded with -100) means over the targets it does not ignore, so weighing
        slices by rows would give another update than one device on the whole batch. None
        for a loss that means over rows, or with one slice and no ranks to add."""
        counter = getattr(loss_fn, "counts", None)
        if counter is None or (len(self.executors) == 1 and global_count is None) or any(
                ex.weights is not None for ex in self.executors):
            return None  # sample weights mean over rows (Keras's sum_over_batch_size)
        counts = []
        for ex in self.executors:
            labels = ex.valid_rows(ex.labels) if ex.labels is not None and ex.valid else None
            c = counter(labels) if labels is not None else None
            if c is None and labels is not None:
                return None  # the loss means over rows after all
            counts.append(torch.zeros((), device=ex.device) if c is None else c.float())
        total = torch.stack([c.to(self.executors[0].device, non_blocking=True)
                             for c in counts]).sum()
        if global_count is not None:
            total = global_count(total)
        return counts, total.clamp(min=1)

    def _rng_states(self) -> list[torch.Tensor]:
        """The states of the generators the replicas draw from (one per distinct device)."""
        return [torch.get_rng_state() if d.type == "cpu" else torch.cuda.get_rng_state(d)
                for d in dict.fromkeys(ex.device for ex in self.executors)]

    def _draws_in_turn(self) -> bool:
        """Whether training forwards must run one after another, in device order.

        Replicas on one device share its generator (every CPU replica shares torch's CPU
        generator): run at once, their dropout masks depend on which thread draws first, and a
        seeded run is not reproducible. So a module that draws random numbers runs such
        replicas' forwards in device order (backward stays concurrent); one that never draws
        keeps them concurrent. Decided once per group: by its layers, or else by whether its
        first training forward (run in turn) moved the generators (``stochastic`` stays None
        until then).
        """
        if self.stochastic is None:
            devices = [ex.device for ex in self.executors]
            if len(set(devices)) == len(devices):  # one generator each: no race
                self.stochastic = False
            elif any(isinstance(m, _RANDOM_LAYERS) and getattr(m, "p", 1) > 0
                     for m in self.executors[0].module.modules()):
                self.stochastic = True
        return self.stochastic is not False

    def backward(self, scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Backward on every replica, at once."""
        self._run(lambda ex: ex.backward(scale))

    def update_metric(self, metric: Any, labels: Any = None) -> None:
        """Update each device's clone of ``metric`` with that device's outputs and labels."""

        def update(ex: Executor, d: int) -> None:
            lab = ex.labels if labels is None else take_rows(labels, self.slices[d], ex.axis)
            if ex.valid > 0:
                metric.update(d, ex.valid_rows(ex.outputs), ex.valid_rows(lab),
                              ex.valid_rows(ex.weights))

        self.workers.run([functools.partial(update, ex, d) for d, ex in enumerate(self.executors)])
        metric.end_batch(self.executors[0].axis)  # the metrics that update with the whole batch

    def outputs(self) -> list[Any]:
        """Each device's outputs, padding rows removed."""
        return [ex.valid_rows(ex.outputs) for ex in self.executors]

