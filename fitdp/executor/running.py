"""One batch in one hand-off per device (``run_batch``), and the work loads it measures.

Mixed into ``DataParallelExecutorManager`` (like ``OptimizerStepMixin``): the per-batch path
``Model`` trains on, the fused zero/step of ``fitdp.executor.fused``, ``work_load_list="auto"``
and the slow-replicas check of ``fitdp.executor.balance``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fitdp.checks import FitdpWarning
from fitdp.data.batch import DataBatch, axis_of, batch_axis
from fitdp.executor.balance import LoadBalancer, SlowReplicaCheck, slow_replicas_message
from fitdp.executor.executor import Executor, LossFn
from fitdp.executor.fused import SHARD_MIN_NUMEL, FusedUpdate
from fitdp.executor.interrupts import GUARD
from fitdp.executor.reduce import FlatBuckets
from fitdp.executor.slicing import check_work_load_arg
from fitdp.executor.step import ShardedStep

if TYPE_CHECKING:
    from fitdp.executor.group import DataParallelExecutorGroup


class BatchRunMixin:
    """``run_batch`` and the work loads, for ``DataParallelExecutorManager`` (it reads the
    manager's devices, groups, loss, flat buckets and slicing; see there)."""

    devices: list[torch.device]
    distributed: bool
    loss: LossFn | None
    autocast_dtype: torch.dtype | None
    flat: FlatBuckets | None
    logger: logging.Logger
    work_load_list: list[float]
    balancer: LoadBalancer | None
    _speed_check: SlowReplicaCheck | None
    _fused: dict[int, FusedUpdate]
    _slices: dict[int, list[slice]]
    _reserved: list[Any]
    _fusable: bool
    _shardable: bool
    _masters: list[torch.nn.Parameter]
    _one: Executor | None
    bucket_module: Any
    execgrp: DataParallelExecutorGroup

    if TYPE_CHECKING:  # the manager's
        def _group_of(self, data_batch: DataBatch, checked: bool = False
                      ) -> DataParallelExecutorGroup: ...

        def _slices_for(self, rows: int) -> list[slice]: ...

        def _global_rows(self, local: int) -> int | torch.Tensor: ...

        def master_parameters(self) -> list[torch.nn.Parameter]: ...

        def reserve(self, descs: Sequence[Any]) -> None: ...

        def step(self, optimizer: torch.optim.Optimizer, *,
                 scaler: torch.amp.GradScaler | None = None,
                 clip_norm: float | None = None) -> None: ...

    def _init_loads(self, work_load_list: Sequence[float] | str | None) -> None:
        self.work_load_list = [1.0] * len(self.devices)
        self.balancer = None
        self._fused, self._slices, self._reserved = {}, {}, []
        self.set_work_load_list(work_load_list)
        cpu = all(d.type == "cpu" for d in self.devices)
        several = len(self.devices) > 1
        self._speed_check = SlowReplicaCheck() if cpu and several else None
        # The optimizer step inside the batch's hand-off: one device, or CPU replicas with
        # flat gradient buckets (a step across ranks or GPUs goes through ``step``).
        self._fusable = not self.distributed and (not several or (cpu and self.flat is not None))
        masters = self._masters = self.master_parameters()
        numel = sum(p.numel() for p in masters)
        # One CPU replica whose executor needs no context (compile, input gradients,
        # autocast, buckets): ``_run_one``.
        ex = self.execgrp.executors[0]
        simple = not (ex.compiled or ex.inputs_need_grad or ex.warn_on_grow)
        self._one = ex if (not several and cpu and not self.distributed and simple
                           and self.autocast_dtype is None and self.bucket_module is None
                           ) else None
        self._shardable = several and self.flat is not None and numel >= SHARD_MIN_NUMEL

    def run_batch(
        self,
        data_batch: DataBatch,
        is_train: bool,
        *,
        total_rows: int | None = None,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        metric: Any = None,
        zero_grad: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        clip_norm: float | None = None,
    ) -> None:
        """One batch with one hand-off per device: each device thread loads its slice, runs
        forward (and backward when training) and updates its clone of ``metric`` (a
        ``DeviceMetrics``); the same numbers as ``load_data_batch``, ``forward``,
        ``backward(reduce=False)`` and ``update_metric`` in turn, with a thread wake-up per
        device instead of one per call.

        Args:
            data_batch: the batch.
            is_train: train (backward) or only forward.
            total_rows: see ``forward``.
            scale: see ``backward``.
            metric: a ``DeviceMetrics`` to update, or None.
            zero_grad: zero the gradients first (the first batch of an optimizer step).
            optimizer: also take the optimizer step after backward, as ``step`` does with
                ``scaler`` and ``clip_norm``; on CPU replicas (or one device) without them,
                inside the same hand-off, each thread stepping its share of the parameters.
        """
        rows, axis = checked_rows(data_batch)
        one = self._one
        if one is not None and scaler is None and clip_norm is None:
            if optimizer is None:
                self._run_one(one, data_batch, rows, axis, is_train, total_rows, scale, metric,
                              zero_grad, None)
            else:
                with GUARD.critical():  # a Ctrl-C during the step is raised after it
                    self._run_one(one, data_batch, rows, axis, is_train, total_rows, scale,
                                  metric, zero_grad, optimizer)
            return
        group = self._group_of(data_batch, checked=True)
        slices = self._slices_for(rows)
        total: int | torch.Tensor | None = total_rows
        if total is None:
            total = rows - data_batch.pad
            if self.distributed and is_train and self.loss is not None:
                total = self._global_rows(total)
        fused = optimizer is not None and scaler is None and clip_norm is None and (
            self._fusable)
        update = None
        if is_train and (zero_grad or fused):
            update = self._fused_update(optimizer if fused else None)
            update.prepare(zero_grad, optimizer if fused else None)
        check, balancer = self._speed_check, self.balancer
        serial = is_train and check is not None and check.serial_next()
        timed = balancer is not None or (check is not None and is_train)
        count = all_reduce if self.distributed else None
        if optimizer is None:  # changes no weight: nothing to guard
            group.run(data_batch, rows, axis, slices, is_train, self.loss, total,
                      self.autocast_dtype, scale, metric, update, count, serial, timed)
        else:
            with GUARD.critical():  # a Ctrl-C during the step is raised after it
                group.run(data_batch, rows, axis, slices, is_train, self.loss, total,
                          self.autocast_dtype, scale, metric, update, count, serial, timed)
                if not fused:
                    self.step(optimizer, scaler=scaler, clip_norm=clip_norm)
        if check is not None and is_train:
            self._check_speed(check, group.section_seconds(serial), serial)
        if balancer is not None and not serial:
            new = balancer.record([s.stop - s.start for s in slices], group.times)
            if new is not None:
                self._use_loads(new, group.times)

    def _run_one(self, ex: Executor, batch: DataBatch, rows: int, axis: int, is_train: bool,
                 total_rows: int | None, scale: Callable[[torch.Tensor], torch.Tensor] | None,
                 metric: Any, zero_grad: bool, optimizer: torch.optim.Optimizer | None) -> None:
        """``run_batch`` on one CPU replica that needs nothing but its module: the group's
        steps, in order, without a hand-off's bookkeeping (measured on the 32-64-64-10 MLP,
        batch 32: the step's overhead over a hand-written loop fell from 15 us to 10, of
        about 260)."""
        if ex.module.training is not is_train:
            ex.module.train(is_train)
        if is_train and zero_grad:
            for p in self._masters:
                p.grad = None
        self.execgrp.slices = self._slices_for(rows)
        valid = rows - batch.pad
        ex.load(batch.data, batch.label, valid, batch.sample_weight, axis)
        total = valid if total_rows is None else total_rows
        ex.forward(is_train, self.loss, valid / float(max(total, 1)), None, None)
        if is_train:
            ex.backward(scale)
        if metric is not None and valid > 0:
            metric.update(0, ex.valid_rows(ex.outputs), ex.valid_rows(ex.labels),
                          ex.valid_rows(ex.weights))
        if optimizer is not None:
            optimizer.step()

    def set_work_load_list(self, work_load_list: Sequence[float] | str | None) -> None:
        """Each device's share of a batch from now on: a list (see ``split_input_slice``),
        None for equal shares, or ``"auto"``: measured. With ``"auto"`` the manager times
        each device's share of every batch (load, forward, backward, metrics), sets the
        loads so the devices finish together, and measures again when their times drift
        apart; ``work_load_list`` holds the loads in use, and each change is logged (INFO,
        the ``fitdp`` logger). The update is the whole batch's whatever the split."""
        loads = check_work_load_arg(work_load_list, len(self.devices))
        if isinstance(loads, str):  # "auto"
            if self.balancer is None:
                self.balancer = LoadBalancer(len(self.devices))
                self._use_loads(self.balancer.loads, None)
            return
        self.balancer = None
        if loads != self.work_load_list:
            self._use_loads(loads, None)

    def _use_loads(self, loads: list[float], seconds: Sequence[float] | None) -> None:
        self.work_load_list[:] = loads  # in place: whoever holds the list sees the loads
        self._slices.clear()
        if self._reserved:
            self.reserve(self._reserved)
        if seconds is not None:
            self.logger.info("fitdp: work_load_list='auto' now %s on %s (device times %s ms "
                             "per batch before)", loads, [str(d) for d in self.devices],
                             [round(t * 1e3, 3) for t in seconds])

    def _check_speed(self, check: SlowReplicaCheck, seconds: float, serial: bool) -> None:
        verdict = check.record(serial, seconds)
        if check.done:
            self._speed_check = None  # decided: nothing more to measure
        if verdict is not None:
            # At the user's fit: _check_speed, run_batch, train_step, run_batches,
            # train_epoch, fit.
            warnings.warn(slow_replicas_message(len(self.devices), *verdict), FitdpWarning,
                          stacklevel=7)

    def _fused_update(self, optimizer: torch.optim.Optimizer | None) -> FusedUpdate:
        """The update for this batch: split over the threads when that pays (see
        ``SHARD_MIN_NUMEL``) and ``optimizer`` steps each parameter on its own."""
        shards = len(self.devices) if (optimizer is not None and self._shardable
                                       and ShardedStep.supports(optimizer)) else 1
        update = self._fused.get(shards)
        if update is None:
            update = self._fused[shards] = FusedUpdate(self.flat, self.master_parameters(), shards)
        return update


def checked_rows(batch: DataBatch) -> tuple[int, int]:
    """The batch's rows and batch axis, after ``DataBatch.check_rows`` (a batch of one data
    tensor and one label tensor is checked here without walking its trees: every step)."""
    data, label, weight = batch.data, batch.label, batch.sample_weight
    axis = batch_axis(batch.layout)
    if (isinstance(data, torch.Tensor) and data.dim() > axis and weight is None
            and (label is None or isinstance(label, torch.Tensor) and label.dim())):
        rows = data.shape[axis]
        if label is None or label.shape[axis_of(label, axis)] == rows:
            return rows, axis
    batch.check_rows()  # the message, or a batch of trees
    return batch.batch_size, axis


def all_reduce(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks (a counted loss's denominator)."""
    dist.all_reduce(value)
    return value
