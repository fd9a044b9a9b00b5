"""The step of a call, bound once (``BatchStep``), and the manager's entry points into it.

Like Keras's ``make_train_function``, ``DataParallelExecutorManager.bind_step`` builds one
``BatchStep`` per call from what the call fixes: the devices, ranks, buckets and compile of
the manager, the loss computation (``manager.compute``), the cross-rank gradient reduction
(``manager.cross_rank``), and the ``Update`` (optimizer, scaler, clipping, sharded or not).
Per batch it is told only what changes per batch: the batch, whether it zeroes the gradients
first (the first batch of an optimizer step), whether it ends with the step, and its rows.
It loads, runs and steps the batch in one hand-off per device, each device running the one
per-replica routine (``per_replica.device_share``). ``run_batch`` and ``step`` are the
public calls into it; neither enters the Ctrl-C guard twice: ``Model`` holds it once per step
and calls the bound step directly.

Mixed into ``DataParallelExecutorManager`` with the work loads that the step measures
(``work_load_list="auto"``, the slow-replicas check of ``fitdp.executor.balance``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fitdp.checks import FitdpWarning
from fitdp.data.batch import DataBatch, checked_rows
from fitdp.executor.balance import LoadBalancer, SlowReplicaCheck, slow_replicas_message
from fitdp.executor.engines import set_sync
from fitdp.executor.flat_buckets import FlatBuckets
from fitdp.executor.interrupts import GUARD
from fitdp.executor.per_replica import NAMED_PHASES, PHASES, weigh
from fitdp.executor.replica import Compute
from fitdp.executor.reproducible import ReproducibleStep
from fitdp.executor.sharded_step import ShardedStep
from fitdp.executor.slicing import check_work_load_arg
from fitdp.executor.update import SHARD_MIN_NUMEL, NamedUpdate, Update
from fitdp.executor.workers import DeviceWorkers

if TYPE_CHECKING:
    from fitdp.executor.group import DataParallelExecutorGroup

Scale = Callable[[torch.Tensor], torch.Tensor]


class BatchStep:
    """One batch's step, bound once per call (see the module docstring).

    Args:
        mgr: the manager.
        is_train: train (backward, and the update's zeroing and step) or only forward.
        update: the training update (None: evaluation).
        scale: multiplies each loss before backward (a ``GradScaler``'s ``scale``), or None.
        metric: a ``DeviceMetrics`` each device updates with its slice, or None.
        named: run the phases in named ranges for a profiler (``per_replica.NAMED_PHASES``).
    """

    def __init__(self, mgr: StepMixin, is_train: bool, update: Update | None,
                 scale: Scale | None, metric: Any, named: bool = False) -> None:
        # The manager keeps its bound steps (``_bound``): a weak reference back, so the pair
        # is no cycle and a dropped manager (its worker threads) goes at once, not when the
        # garbage collector runs. A few attribute reads per batch through the proxy.
        self.mgr: StepMixin = weakref.proxy(mgr)
        self.is_train, self.update = is_train, update
        self.scale, self.metric = scale, metric
        self.phases = NAMED_PHASES if named else PHASES
        self.compute = mgr.compute
        # Counts weigh slices only when there are several (devices or ranks): decided here.
        several = len(mgr.devices) > 1 or mgr.distributed
        self.counter = getattr(mgr.compute, "counts", None) if several else None
        self.global_count = all_reduce if mgr.distributed else None
        # Ranks' batches may differ in size: the rows of a step are summed over the ranks.
        self.global_rows = mgr._global_rows if (
            mgr.distributed and is_train and mgr.loss is not None) else None
        self.autocast = mgr.autocast_dtype
        # DDP's module, read per batch through the executor (dropped at exit, see engines);
        # a replica that runs under no engine (bound at the manager's start) has none.
        lead = mgr.execgrp.executors[0]
        self.lead = lead if is_train and lead.ranked is not None else None
        # Read once, not through the proxy per batch: the one group without buckets, the
        # slices by rows (cleared in place when the loads change), and whether the one CPU
        # replica's share runs on this thread (as ``DeviceWorkers.run`` would, less the list).
        self.group = mgr.execgrp if mgr.bucket_module is None else None
        self.slices = mgr._slices
        self.on_caller = len(mgr.devices) == 1 and mgr.devices[0].type == "cpu"
        self.samples = 0  # rows run so far, padding left out (a call's throughput reads it)

    def __call__(self, batch: DataBatch, *, zero_grad: bool = False, step: bool = False,
                 total_rows: int | torch.Tensor | None = None) -> None:
        """Load, forward, backward (training), metrics and, with ``step``, the optimizer
        update of ``batch``; ``zero_grad``: zero the gradients first; ``total_rows``: the
        rows the mean loss is taken over (default: this batch's, summed over the ranks)."""
        rows, axis = checked_rows(batch)
        self.samples += rows - batch.pad
        group = self.group or self.mgr._group_of(batch, checked=True)
        slices = self.slices.get(rows) or self.mgr._slices_for(rows)
        job = group.job
        job.set(batch, rows, axis, slices)
        job.is_train, job.compute, job.autocast = self.is_train, self.compute, self.autocast
        job.scale, job.metric, job.phases = self.scale, self.metric, self.phases
        if total_rows is None:
            total_rows = rows - batch.pad
            if self.global_rows is not None:
                total_rows = self.global_rows(total_rows)
        weigh(job, total_rows, self.counter, self.global_count)
        update = self.update
        stepping = False
        if update is not None:
            stepping = update.prepare(zero_grad, step)
            lead = self.lead
            if lead is not None and lead.ranked is not None:
                set_sync(lead.ranked, stepping)  # DDP reduces in backward: on the step's batch
            job.update = update if zero_grad or stepping else None
        else:
            job.update = None
        mgr = self.mgr
        if mgr._speed_check is not None or mgr.balancer is not None:
            self._measured(group, job, stepping)  # several CPU replicas, or "auto" loads
            return
        if stepping and update.shards > 1:  # type: ignore[union-attr]
            group.dispatch(group.tasks, False, False)  # each device thread steps its shard
            return
        group.dispatch(group.shares, self.on_caller, False)
        if stepping:
            update.finish_all()  # type: ignore[union-attr]

    def _measured(self, group: DataParallelExecutorGroup, job: Any, stepping: bool) -> None:
        """The hand-off of a batch whose shares are timed: the slow-replicas check (several
        CPU replicas) and ``work_load_list="auto"``."""
        mgr, update = self.mgr, self.update
        check = mgr._speed_check if self.is_train else None
        balancer = mgr.balancer
        serial = check is not None and check.serial_next()
        timed = balancer is not None or check is not None
        sharded = stepping and not serial and update.shards > 1  # type: ignore[union-attr]
        group.dispatch(group.tasks if sharded else group.shares, serial or self.on_caller,
                       timed)
        if stepping and not sharded:
            update.finish_all()  # type: ignore[union-attr]
        if check is not None:
            mgr._check_speed(check, group.section_seconds(serial), serial)
        if balancer is not None and not serial:
            # This batch's times on the CPU; on CUDA those of the batches whose events have
            # run by now (see ShareClock: no host sync).
            for done_rows, seconds in job.clock.finished([s.stop - s.start for s in job.slices],
                                                        group.times):
                new = balancer.record(done_rows, seconds)
                if new is not None:
                    mgr._use_loads(new, seconds)
                    job.clock.forget()  # the batches still pending ran the old loads
                    break

    def step_now(self) -> None:
        """The optimizer step alone, from the gradients of the batches run so far."""
        assert self.update is not None  # noqa: S101 - a training step
        self.update.step_all(self.mgr.workers.run)


class StepMixin:
    """The manager's step: binding it, ``run_batch``, ``step``, zeroing, reducing, and the
    work loads (it reads the manager's devices, groups, flat buckets and slicing)."""

    devices: list[torch.device]
    distributed: bool
    loss: Any
    compute: Compute
    cross_rank: Callable[[], None] | None
    autocast_dtype: torch.dtype | None
    flat: FlatBuckets | None
    workers: DeviceWorkers
    logger: logging.Logger
    work_load_list: list[float]
    balancer: LoadBalancer | None
    trainable: list[bool]
    _speed_check: SlowReplicaCheck | None
    _slices: dict[int, list[slice]]
    _reserved: list[Any]
    _shardable: bool
    _bound: dict[tuple[Hashable, ...], BatchStep]
    _reproducible: dict[tuple[Hashable, ...], ReproducibleStep]
    _manual: dict[tuple[Hashable, ...], Update]
    execgrp: DataParallelExecutorGroup
    bucket_module: Any

    if TYPE_CHECKING:  # the manager's
        @property
        def param_names(self) -> list[str]: ...

        @property
        def param_arrays(self) -> list[list[torch.nn.Parameter]]: ...

        def _group_of(self, data_batch: DataBatch, checked: bool = False
                      ) -> DataParallelExecutorGroup: ...

        def _slices_for(self, rows: int) -> list[slice]: ...

        def reserve(self, descs: Sequence[Any]) -> None: ...

    def _init_loads(self, work_load_list: Sequence[float] | str | None) -> None:
        self.work_load_list = [1.0] * len(self.devices)
        self.balancer = None
        self._slices, self._reserved, self._bound = {}, [], {}
        self._manual, self._reproducible = {}, {}
        self.set_work_load_list(work_load_list)
        cpu = all(d.type == "cpu" for d in self.devices)
        several = len(self.devices) > 1
        self._speed_check = SlowReplicaCheck() if cpu and several else None
        numel = sum(p.numel() for p in self.master_parameters())
        # The step split over CPU replica threads: where it pays (see SHARD_MIN_NUMEL).
        self._shardable = several and cpu and self.flat is not None and numel >= SHARD_MIN_NUMEL

    def bind_step(self, is_train: bool, *, optimizer: torch.optim.Optimizer | None = None,
                  scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None,
                  scale: Scale | None = None, metric: Any = None, named: bool = False,
                  micro_batch_size: int | None = None) -> BatchStep | ReproducibleStep:
        """The step for a call's batches, from what the call fixes (made once per set of
        arguments and kept): ``step(batch, zero_grad=, step=, total_rows=)`` trains (or,
        not ``is_train``, evaluates) a batch; ``step.step_now()`` takes the optimizer step
        alone. The caller holds the Ctrl-C guard (``GUARD.critical``) around a batch that
        steps; ``run_batch`` does that for one batch.

        Args:
            is_train: train or evaluate.
            optimizer: built on ``master_parameters()``; None: gradients only.
            scaler: the ``GradScaler`` of a 16-mixed run, or None.
            clip_norm: max global norm of the gradients, or None.
            scale: multiplies each loss before backward, or None.
            metric: a ``DeviceMetrics`` to update per device slice, or None.
            named: the phases (load, forward, backward, metrics, reduce, step) in
                ``torch.profiler.record_function`` ranges named ``fitdp.<phase>``, for a
                profiler's trace; without it the step runs no range code at all.
            micro_batch_size: the reproducible step of ``fit(reproducible=True)``
                (``fitdp.executor.reproducible``), in micro-batches of this many rows.
        """
        key = (is_train, optimizer, scaler, clip_norm, scale, metric, named, micro_batch_size)
        if micro_batch_size is not None:
            made = self._reproducible.get(key)
            if made is None or not made.fits(optimizer):
                if len(self._reproducible) >= 16:  # (as below)
                    self._reproducible.clear()
                made = self._reproducible[key] = ReproducibleStep(
                    self, is_train, micro_batch_size, optimizer=optimizer, scaler=scaler,
                    clip_norm=clip_norm, scale=scale, metric=metric)
            return made
        bound = self._bound.get(key)
        if bound is None or (bound.update is not None and not bound.update.fits(optimizer)):
            update = self._update(optimizer, scaler, clip_norm, named) if is_train else None
            if len(self._bound) >= 16:  # a new loss-scale closure per call: keep a few
                self._bound.clear()
            bound = self._bound[key] = BatchStep(self, is_train, update, scale, metric, named)
        return bound

    def _update(self, optimizer: torch.optim.Optimizer | None,
                scaler: torch.amp.GradScaler | None, clip_norm: float | None,
                named: bool = False) -> Update:
        sharded = (optimizer is not None and self._shardable and scaler is None
                   and clip_norm is None and self.cross_rank is None
                   and ShardedStep.supports(optimizer))
        kind = NamedUpdate if named else Update
        return kind(self.flat, self.master_parameters(), optimizer,
                    len(self.devices) if sharded else 1, scaler=scaler, clip_norm=clip_norm,
                    cross_rank=self.cross_rank)

    def manual_update(self, optimizer: torch.optim.Optimizer, *,
                      scaler: torch.amp.GradScaler | None = None,
                      clip_norm: float | None = None) -> Update:
        """The update of one of several optimizers that a custom ``train_step`` steps itself
        (``Model.optimizer_step``): the same reduce, unscale, clip (its own parameters),
        step and broadcast as the bound step's, on one thread (the replicas' meeting), so
        never sharded. Made once per optimizer and kept with the bound steps."""
        key = ("manual", optimizer, scaler, clip_norm)
        update = self._manual.get(key)
        if update is None or not update.fits(optimizer):
            update = self._manual[key] = Update(
                self.flat, self.master_parameters(), optimizer, 1, scaler=scaler,
                clip_norm=clip_norm, cross_rank=self.cross_rank)
        return update

    def run_batch(
        self,
        data_batch: DataBatch,
        is_train: bool,
        *,
        total_rows: int | None = None,
        scale: Scale | None = None,
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
        device instead of one per call. (``bind_step`` once per call does the same without
        looking the step up per batch.)

        Args:
            data_batch: the batch.
            is_train: train (backward) or only forward.
            total_rows: see ``forward``.
            scale: see ``backward``.
            metric: a ``DeviceMetrics`` to update, or None.
            zero_grad: zero the gradients first (the first batch of an optimizer step).
            optimizer: also take the optimizer step after backward, as ``step`` does with
                ``scaler`` and ``clip_norm`` (on CPU replicas, each thread stepping its share
                of the parameters where that pays).
        """
        bound = self.bind_step(is_train, optimizer=optimizer, scaler=scaler,
                               clip_norm=clip_norm, scale=scale, metric=metric)
        guard = GUARD.critical() if optimizer is not None else _NULL
        with guard:  # a Ctrl-C during the step is raised after it
            bound(data_batch, zero_grad=zero_grad, step=optimizer is not None,
                  total_rows=total_rows)

    def step(self, optimizer: torch.optim.Optimizer, *,
             scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None
             ) -> None:
        """One optimizer step on every replica, from the gradients of the last backward(s).

        The whole sequence, in order: reduce the gradients into device 0 (and across ranks);
        unscale them (``scaler``, 16-mixed); clip their global norm to ``clip_norm``; step
        ``optimizer`` on device 0's parameters (with several CPU replicas, split over the
        device threads where that pays: bit for bit the same update); copy device 0's
        parameters to every other device. A Ctrl-C during the sequence is raised after it,
        never between an update and its broadcast.

        Args:
            optimizer: built on ``named_master_parameters()`` (or ``master_parameters()``).
            scaler: the ``GradScaler`` of a 16-mixed run, or None.
            clip_norm: max global norm of the gradients, or None.
        """
        with GUARD.critical():
            self.bind_step(True, optimizer=optimizer, scaler=scaler,
                           clip_norm=clip_norm).step_now()

    def _gradients(self) -> Update:
        """The update without an optimizer: zeroing, reducing and broadcasting alone."""
        return self.bind_step(True).update  # type: ignore[return-value]

    def zero_grad(self) -> None:
        """Zero the gradients on every device."""
        update = self._gradients()
        for d in range(len(self.devices)):
            update.zero_device(d)

    def reduce_gradients(self) -> None:
        """Sum every device's gradients into device 0's (then across ranks)."""
        self._gradients().reduce_shard(0)

    def sync_params(self) -> None:
        """After an optimizer step on device 0, copy its parameters to every other device."""
        self._gradients().broadcast_shard(0)

    def _global_rows(self, local: int) -> int | torch.Tensor:
        """This step's rows summed over ranks (ranks' batches may differ in size)."""
        on_cpu = self.devices[0].type == "cpu"
        # torch.full fills on the device from a kernel argument; torch.tensor([local],
        # device=...) would build it on the host and copy it over, blocking, every step.
        total = torch.full((1,), float(local), device=self.devices[0])
        dist.all_reduce(total)
        # On CUDA the weight stays a device tensor: no host sync per step.
        return int(total.item()) if on_cpu else total

    def named_master_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Device 0's parameters by name, frozen ones too: bind the optimizer to these."""
        return {name: block[0] for name, block in zip(self.param_names, self.param_arrays)}

    def master_parameters(self) -> list[torch.nn.Parameter]:
        """Device 0's trainable parameters: the ones the optimizer steps."""
        return [block[0] for block, on in zip(self.param_arrays, self.trainable) if on]

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

    def measures(self) -> dict[str, Any] | None:
        """What the manager has measured of its devices so far (``work_load_list="auto"``'s
        loads and window, the slow-replicas check's batches), plain numbers for a
        checkpoint: a run resumed on the same devices then splits each batch, and runs it
        at once or one share after another, as the uninterrupted run does (the split is
        part of the arithmetic, so this is what a bitwise resume needs). None: nothing
        measured nor to measure (one device, or a list of loads once the check is done)."""
        balancer, check = self.balancer, self._speed_check
        if balancer is None and check is None:
            return None
        return {"devices": len(self.devices),
                "balancer": balancer.state_dict() if balancer is not None else None,
                "speed_check": check.state_dict() if check is not None else None}

    def load_measures(self, state: Mapping[str, Any]) -> None:
        """Go on from ``measures`` (a resume). Another number of devices measures anew; a
        call with a list of loads keeps its list (no balancer to go on with)."""
        if int(state["devices"]) != len(self.devices):
            return
        if self.balancer is not None and state["balancer"] is not None:
            self.balancer.load_state_dict(state["balancer"])
            self._use_loads(self.balancer.loads, None)
        if self._speed_check is not None:
            if state["speed_check"] is None:  # decided in the saved run: nothing to measure
                self._speed_check = None
            else:
                self._speed_check.load_state_dict(state["speed_check"])

    def _check_speed(self, check: SlowReplicaCheck, seconds: float, serial: bool) -> None:
        verdict = check.record(serial, seconds)
        if check.done:
            self._speed_check = None  # decided: nothing more to measure
        if verdict is not None:
            # At the fit: _check_speed, _measured, the bound step, _one_batch, train_step,
            # run_batches, train_epoch, fit.
            warnings.warn(slow_replicas_message(len(self.devices), *verdict), FitdpWarning,
                          stacklevel=8)


_NULL = contextlib.nullcontext()  # reusable: entering it has no state


def all_reduce(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks (a counted loss's denominator)."""
    dist.all_reduce(value)
    return value
