"""The data-parallel executor manager (MXNet's ``DataParallelExecutorManager``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.data.batch import DataBatch, take_rows, tree_map
from fitdp.executor import checks
from fitdp.executor.averaging import average_into, average_replicas
from fitdp.executor.balance import Balancing, LoadBalancer
from fitdp.executor.compile_config import CompileConfig, check_compile
from fitdp.executor.devices import DevicesArg, resolve_devices
from fitdp.executor.engine import Engine
from fitdp.executor.group import DataParallelExecutorGroup
from fitdp.executor.local_reduce import LocalReduce
from fitdp.executor.replica import Compute, LossFn, ModuleLoss
from fitdp.executor.reproducible import ReproducibleStep
from fitdp.executor.sharing import bucket_replicas, check_unique_names, hashable
from fitdp.executor.slicing import check_work_load_arg, device_slices
from fitdp.executor.step import (
    LOAD,
    DeviceWorkers,
    Phases,
    Scale,
    Step,
)
from fitdp.executor.update import Update, UpdateOptions, new_update
from fitdp.executor.weighing import Weighing

# Parameters or buffers: names, their ``[name][device]`` tensors, and the caller's by name.
_FIRST = operator.itemgetter(0)  # a block's first replica's tensor
_Named = tuple[list[str], Sequence[Sequence[torch.Tensor]], Mapping[str, torch.Tensor]]


class DataParallelExecutorManager:
    """Run one module data-parallel over several devices, with bucketing.

    Keeps a persistent replica per device, splits each batch by the work load list, runs the
    replicas at once, reduces gradients in flat buckets (then across ranks), and copies the
    device-averaged weights back to the host for saving. With ``bucket_module`` every new
    bucket key gets its own executor group whose module shares every parameter and buffer
    with the default bucket's, and whose input buffers share memory with the other buckets'.

    Args:
        module: the network (the host copy). With one device already holding it, the replica
            is ``module`` itself; otherwise every replica is a copy.
        devices: see ``fitdp.executor.devices.resolve_devices``.
        work_load_list: relative share of each device; default equal. ``"auto"``: measured
            (see ``set_work_load_list``).
        bucket_module: ``callable(bucket_key) -> nn.Module`` (MXNet's ``sym_gen``).
        default_bucket_key: the bucket ``module`` itself runs.
        logger: where warnings go (default: the ``fitdp`` logger).
        loss: ``callable(outputs, targets) -> scalar``, mean over the batch.
        compute: ``compute(executor, training) -> (loss, outputs)``, a custom step run in
            place of forward and ``loss`` on every slice (``fitdp.call.custom_step``); one
            with ``takes_turns`` runs its replicas one after another where they share a
            generator and draw from it, passing the turn where they meet. Default:
            ``ModuleLoss(loss)``.
        compile: ``torch.compile`` every executor.
        autocast_dtype: run forward under ``torch.autocast`` with this dtype.
        distributed: also all-reduce gradients across the default process group (through
            ``engine``; default: fitdp's own flat buckets, ``LocalReduce``).
        inputs_need_grad: track the inputs' gradients in training (MXNet's bind option), read
            with ``get_input_grads``.
        forward_kwargs: keyword arguments every forward gets (``ModuleLoss``).
        engine: how the replicas are made and reduce across devices and ranks
            (``fitdp.executor.engine``; ``fitdp.executor.engines.engine_for`` chooses it
            for a call). Default: ``LocalReduce(distributed)``.

    Example:
        >>> mgr = DataParallelExecutorManager(nn.Linear(4, 2), ["cpu", "cpu"],
        ...                                   loss=nn.functional.cross_entropy)
        >>> mgr.load_data_batch(DataBatch(torch.randn(6, 4), torch.tensor([0, 1] * 3)))
        >>> mgr.forward(is_train=True); mgr.backward()
        >>> mgr.slices
        [slice(0, 3, None), slice(3, 6, None)]
    """

    def __init__(
        self,
        module: nn.Module,
        devices: DevicesArg,
        *,
        work_load_list: Sequence[float] | str | None = None,
        bucket_module: Callable[[Any], nn.Module] | None = None,
        default_bucket_key: Hashable | None = None,
        logger: logging.Logger | None = None,
        loss: LossFn | None = None,
        compile: bool | str = False,
        autocast_dtype: torch.dtype | None = None,
        distributed: bool = False,
        inputs_need_grad: bool = False,
        compute: Compute | None = None,
        engine: Engine | None = None,
        forward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        checks.check_module(module)
        checks.check_bucket_module(bucket_module)
        self.devices = resolve_devices(devices)
        self.layout: str | None = None  # the reserved inputs' layout (see ``reserve``)
        check_compile(compile, self.devices)
        self.inputs_need_grad = inputs_need_grad
        check_unique_names(module)
        self.logger = logger or logging.getLogger("fitdp")
        self.loss = loss
        self.compute: Compute = compute if compute is not None else ModuleLoss(
            loss, forward_kwargs)
        self._custom = compute is not None
        self.compile = compile
        self.compile_config = CompileConfig() if compile else None  # for replica threads
        self.autocast_dtype = autocast_dtype
        self.distributed = distributed
        self.bucket_module = bucket_module
        self.default_bucket_key = default_bucket_key
        self.workers = DeviceWorkers(self.devices)
        self.shared_buffers: list[dict[str, tuple[torch.Tensor, tuple[int, ...]]]] = [
            {} for _ in self.devices]
        self.monitor: Any = None
        self.engine = engine if engine is not None else LocalReduce(distributed)
        replicas = self.engine.replicas(module, self.devices, autocast_dtype)
        self.execgrp = self._group(replicas, default_bucket_key)
        self.groups: dict[Hashable, DataParallelExecutorGroup] = {default_bucket_key: self.execgrp}
        self.curr_execgrp = self.execgrp
        # Gradients (flat buckets) for the trainable parameters only: frozen ones are kept
        # equal on every replica like buffers, and never stepped.
        self.trainable = [block[0].requires_grad for block in self.execgrp.param_arrays]
        params = [[row[d] for row, on in zip(self.execgrp.param_arrays, self.trainable) if on]
                  for d in range(len(self.devices))]
        self.flat = self.engine.bind(self.execgrp.executors[0], params)
        # What the step of a call binds: the gradient-only and optimizer updates (they hold
        # no step, so the manager holds no cycle), the slices per batch size, the weighing.
        self._updates: dict[UpdateOptions, Update] = {}
        self._weighing = Weighing(None, self.devices, distributed)
        # Callables each optimizer step runs first (an async save still copying the
        # weights waits there; see ``fitdp.saving.fence``).
        self.before_step: list[Callable[[], None]] = []
        self.work_load_list = [1.0] * len(self.devices)
        self.balancer: LoadBalancer | None = None
        self.balancing: Balancing | None = None  # the balancer's timing, for the steps
        self.row_slices: dict[int, list[slice]] = {}
        self._reserved: list[Any] = []
        self.set_work_load_list(work_load_list)
        self.logger.debug("fitdp: data parallel on %s", self.devices)

    # -- the seed's surface -------------------------------------------------------------

    @property
    def param_names(self) -> list[str]:
        return self.execgrp.param_names

    @property
    def aux_names(self) -> list[str]:
        return self.execgrp.aux_names

    @property
    def param_arrays(self) -> list[list[nn.Parameter]]:
        """``[parameter][device]``, shared by every bucket."""
        return self.execgrp.param_arrays

    @property
    def grad_arrays(self) -> list[list[torch.Tensor | None]]:
        return self.execgrp.grad_arrays

    @property
    def aux_arrays(self) -> list[list[torch.Tensor]]:
        return self.execgrp.aux_arrays

    @property
    def slices(self) -> list[slice]:
        return self.curr_execgrp.slices

    def load_data_batch(self, data_batch: DataBatch) -> None:
        """Pick (or create, on first sight) the batch's bucket group and load the batch.

        A batch without a bucket key (e.g. validation tensors next to bucketed training data)
        runs the default bucket, as does every batch without ``bucket_module``. A batch
        without a layout takes the one ``reserve`` was given (MXNet binds the layout)."""
        checks.check_batch(data_batch)
        if data_batch.layout is None and self.layout is not None:
            data_batch = dataclasses.replace(data_batch, layout=self.layout)
        group = self.group_of(data_batch)
        rows = data_batch.batch_size
        group.job.set(data_batch, rows, data_batch.axis, self.slices_for(rows))
        self._phase(False, LOAD)
        group.job.load = False
        group.warn_grown()

    def _phase(self, is_train: bool, phase: Phases, **bind: Any) -> None:
        """One phase of the step's routine on every device of the current group (the
        MXNet-style calls), under a step bound with ``bind``."""
        self._step(is_train, **bind).phase(self.curr_execgrp, phase)

    def group_of(self, data_batch: DataBatch, checked: bool = False
                 ) -> DataParallelExecutorGroup:
        """The batch's bucket group, made current (its rows checked first, unless
        ``checked``)."""
        if not checked:
            data_batch.check_rows()
        if self.bucket_module is None:
            return self.execgrp  # the only group, always current
        key = self.default_bucket_key if data_batch.bucket_key is None else data_batch.bucket_key
        try:
            group = self.groups.get(key)
        except TypeError:  # unhashable: _bucket_group says so clearly
            group = None
        group = self._bucket_group(key) if group is None else group
        self.curr_execgrp = group
        return group

    def forward(self, is_train: bool = False, *, total_rows: int | None = None) -> None:
        """Run every replica on its slice.

        Args:
            is_train: build the graph for backward and use training-mode layers.
            total_rows: rows the mean loss is taken over (default: this batch's); each
                slice's loss is weighted by ``rows / total_rows`` so the summed gradients
                equal the whole-batch gradient.
        """
        group = self.curr_execgrp
        group.set_mode(is_train)
        step = self._step(is_train)
        group.job.step = step  # (counts may load the slices; the turns read its compute)
        step.weighing.weigh(group.job, total_rows, step.rows_over_ranks)
        probe = group.begin_turns(is_train)
        step.phase(group, Phases(forward=True))
        group.end_turns(probe)

    def backward(
        self, *, reduce: bool = True, scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """Backward on every replica; with ``reduce``, sum gradients into device 0 (and across
        ranks). Pass ``reduce=False`` to accumulate gradients over several batches."""
        self._phase(True, Phases(backward=True), scale=scale)
        if reduce:
            self.reduce_gradients()

    def get_input_grads(self, merge_multi_context: bool = True) -> list[Any]:
        """The gradient of the loss for each input of the last training batch (MXNet's
        ``get_input_grads``; the manager needs ``inputs_need_grad=True``).

        Returns:
            One entry per input (in ``tree_leaves`` order of the batch's data): the whole
            batch's gradient, devices joined along the batch axis on device 0, or with
            ``merge_multi_context=False`` a list of each device's slice. None for an integer
            input.

        Raises:
            RuntimeError: the manager tracks no input gradients, or no batch was trained.
        """
        group = self.curr_execgrp
        if not self.inputs_need_grad or group.executors[0].grad_inputs is None:
            raise RuntimeError("get_input_grads: no input gradients; build the manager with "
                               "inputs_need_grad=True and run forward(is_train=True) and "
                               "backward() first")
        return group.input_grads(merge_multi_context)

    def update_metric(self, metric: Any, labels: Any = None) -> None:
        """Update ``metric`` per device slice.

        ``metric`` is a ``fitdp.compiled.metrics.DeviceMetrics`` (each device updates its own clone,
        on that device) or a plain torchmetrics metric (updated with each slice in turn).
        ``labels`` defaults to the labels loaded with the batch.
        """
        checks.check_metric(metric)
        group = self.curr_execgrp
        if hasattr(metric, "clones"):
            group.job.metric_labels = labels
            try:
                self._phase(False, Phases(metric=True), metric=metric)
            finally:
                group.job.metric_labels = None
            metric.end_batch(group.executors[0].axis)  # those that update with the batch
            return
        for ex, sl in zip(group.executors, group.slices):
            lab = ex.labels if labels is None else take_rows(labels, sl, ex.axis)
            if ex.valid > 0:
                # Owned copies without autograd history: the labels are views of input
                # buffers the next batch overwrites, and a metric may keep what it is given.
                to = tree_map(lambda t: t.detach().to(metric.device, copy=True),
                              (ex.outputs, lab))
                metric.update(*take_rows(to, slice(0, ex.valid),
                                         (ex.output_axes(to[0]), ex.axis)))

    def prepare_buckets(self, keys: Iterable[Hashable]) -> None:
        """Create every bucket's executor group now instead of on first sight, so a
        ``bucket_module`` mistake (a parameter it should share but cannot) is raised before
        training changes any weight. Without ``bucket_module`` there is one group: a no-op."""
        if self.bucket_module is None:
            return
        for key in keys:
            if not (hashable(key) and key in self.groups):
                self._bucket_group(key)

    def install_monitor(self, monitor: Any) -> None:
        """Install ``monitor`` on every bucket group, present and future, and every device."""
        checks.check_monitor(monitor)
        self.monitor = monitor
        for group in self.groups.values():
            self._install(group)

    def set_params(
        self, arg_params: Mapping[str, torch.Tensor], aux_params: Mapping[str, torch.Tensor]
    ) -> None:
        """Copy host parameters and buffers (by name) into every device's replica; every
        name and shape is checked before anything is copied."""
        if self._holds(arg_params, aux_params):
            return  # one replica: the host's own tensors (nothing to check or copy)
        blocks = self._blocks("set_params", arg_params, aux_params)
        for names, arrays, src in blocks:
            for name, block in zip(names, arrays):
                if name in src:
                    value = src[name]
                    for dst in block:
                        if dst.data_ptr() != value.data_ptr():
                            self.engine.copy_into(dst, value)

    def copy_to(
        self, arg_params: Mapping[str, torch.Tensor], aux_params: Mapping[str, torch.Tensor]
    ) -> None:
        """Average every parameter and buffer over devices into the caller's tensors, in place
        (cast to each target's dtype); replicas that agree give their values bit for bit."""
        if self._holds(arg_params, aux_params):
            return  # one replica: the caller's own tensors (nothing to check or average)
        for names, arrays, dst in self._blocks("copy_to", arg_params, aux_params):
            for name, block in zip(names, arrays):
                if name in dst:
                    average_into(dst[name], self.engine.whole(block))

    def sync_buffers(self) -> None:
        """Average every floating buffer (BatchNorm running statistics) over the devices, and
        over the ranks under torch.distributed, into every replica.

        Each replica updates its running statistics from its own slice; after this call
        every replica holds what ``copy_to`` saves, so validation, checkpoint selection and
        the saved model all see the same statistics."""
        average_replicas(self.aux_arrays, distributed=self.distributed)

    # -- what Model needs beyond the seed ------------------------------------------------

    def outputs(self) -> list[Any]:
        """The current batch's outputs per device (padding removed; empty slices left out)."""
        group = self.curr_execgrp
        return [o for ex, o in zip(group.executors, group.outputs()) if ex.valid > 0]

    def output_axes(self) -> Any:
        """The batch axis of each of the current batch's outputs (0 for batch-first data;
        see ``fitdp.data.batch.output_axes`` for time-major data)."""
        ex = next((e for e in self.curr_execgrp.executors if e.valid > 0), None)
        return 0 if ex is None else ex.output_axes(ex.outputs)

    def output_type(self) -> type | None:
        """The class of the current batch's outputs when the module returned a dict (a
        ``ModelOutput``: ``outputs`` holds its per-row fields as a plain dict), else None."""
        ex = next((e for e in self.curr_execgrp.executors if e.valid > 0), None)
        return None if ex is None or isinstance(ex.outputs, torch.Tensor) else ex.output_type

    def loss_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-row losses, rows) since ``reset_loss``, on device 0 (no host sync)."""
        sums, dev = self.loss_sums(), self.devices[0]
        total, count = (torch.stack([s[i].to(dev, non_blocking=True) for s in sums]).sum()
                        for i in (0, 1))
        return total, count

    def reset_loss(self) -> None:
        for g in self.groups.values():
            for ex in g.executors:
                ex.reset_loss()

    def loss_sums(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each executor's (sum of per-row losses, rows) since ``reset_loss`` (checkpoints)."""
        return [ex.fold_losses() for g in self.groups.values() for ex in g.executors]

    def restore_loss(self, sums: Sequence[Sequence[torch.Tensor]]) -> None:
        """Put ``loss_sums`` back: each executor's own (bit for bit the sums it would have),
        or with other executors their total on the first."""
        self.reset_loss()
        executors = [ex for g in self.groups.values() for ex in g.executors]
        if len(sums) != len(executors):
            sums = [[torch.stack([torch.as_tensor(s[i]) for s in sums]).sum() for i in (0, 1)]]
        for ex, (total, count) in zip(executors, sums):
            ex.loss_sum.copy_(total)
            ex.loss_count.copy_(count)

    def reserve(self, descs: Sequence[Any]) -> None:
        """Allocate input buffers for a full batch of ``descs`` (``DataDesc``) up front, so
        smaller buckets take views of them instead of re-allocating. A layout that is not
        batch-first (``"TNC"``) becomes that of every batch loaded without one."""
        self._reserved = list(descs)  # made again when the work loads change
        self.layout = next((d.layout for d in descs if d.batch_axis), None)
        for desc in descs:
            axis = desc.batch_axis if len(desc.shape) > desc.batch_axis else 0
            for ex, s in zip(self.execgrp.executors, self.slices_for(desc.shape[axis])):
                shape = list(desc.shape)
                shape[axis] = s.stop - s.start
                ex.reserve(desc.name, tuple(shape), desc.dtype)

    def close(self) -> None:
        """Stop the device threads (idempotent; they also stop when the manager is
        garbage-collected) and release the engine's hold on the replicas."""
        self.workers.close()
        self.engine.close()

    # -- the step of a call ----------------------------------------------------------------

    def bind_step(self, is_train: bool, *, optimizer: torch.optim.Optimizer | None = None,
                  scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None,
                  scale: Scale | None = None, metric: Any = None, named: bool = False,
                  micro_batch_size: int | None = None, track_norm: bool = False,
                  inspect: Callable[[torch.optim.Optimizer], None] | None = None
                  ) -> Step | ReproducibleStep:
        """The step for a call's batches, from what the call fixes: ``step(batch,
        zero_grad=, step=, total_rows=)`` trains (or, not ``is_train``, evaluates) a batch;
        ``step.step_now()`` takes the optimizer step alone. The caller holds its Ctrl-C
        guard around a batch that steps (``run_batch`` and ``step`` take one as ``guard``).

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
            micro_batch_size: the step of ``fit(reproducible=True)`` instead
                (``fitdp.executor.reproducible``), in micro-batches of this many rows.
            track_norm: every optimizer step takes the gradients' global norm before
                clipping, on the device (the update's ``state.grad_norm``).
            inspect: called with the optimizer after the reduce and the unscale, before
                clipping and the step (``on_before_optimizer_step``).

        Raises:
            ValueError: ``micro_batch_size`` with an engine that shards the weights (FSDP2).
        """
        options = UpdateOptions(optimizer, scaler, clip_norm, named, track_norm=track_norm,
                                inspect=inspect)
        if micro_batch_size is not None:
            # The reproducible step sums the ranks' gradients itself (in a fixed order).
            update = self.update(dataclasses.replace(options, named=False, cross_rank=False))
            return ReproducibleStep(self, is_train, micro_batch_size,
                                    update=update if is_train else None, scale=scale,
                                    metric=metric)
        return self._step(is_train, options, scale=scale, metric=metric)

    def _step(self, is_train: bool, options: UpdateOptions | None = None, *,
              scale: Scale | None = None, metric: Any = None) -> Step:
        """The ordinary step (``bind_step``'s, and the phase calls' without an optimizer)."""
        options = options if options is not None else UpdateOptions()
        update = self.update(options) if is_train else None
        return Step(self, is_train, update, scale, metric, options.named, self.balancing)

    def update(self, options: UpdateOptions) -> Update:
        """The update ``options`` describe, made once and kept (its views of the buckets):
        the one optimizer step of the bound steps, a custom step's ``optimizer_step`` and
        the phase calls below."""
        update = self._updates.get(options)
        if update is None or not update.fits(options.optimizer):
            if len(self._updates) >= 16:  # calls with new optimizers: keep a few
                self._updates.clear()
            update = self._updates[options] = new_update(
                options, self.flat, self.master_parameters(), self.engine, self.before_step)
        return update

    def manual_update(self, optimizer: torch.optim.Optimizer, *,
                      scaler: torch.amp.GradScaler | None = None,
                      clip_norm: float | None = None) -> Update:
        """The update of one of several optimizers that a custom ``train_step`` steps itself
        (``Model.optimizer_step``): the same reduce, unscale, clip (its own parameters),
        step and broadcast as the bound step's."""
        return self.update(UpdateOptions(optimizer, scaler, clip_norm))

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
        guard: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        """One batch with one hand-off per device: each device thread loads its slice, runs
        forward (and backward when training) and updates its clone of ``metric`` (a
        ``DeviceMetrics``); the same numbers as ``load_data_batch``, ``forward``,
        ``backward(reduce=False)`` and ``update_metric`` in turn, with a thread wake-up per
        device instead of one per call. (``bind_step`` once per call does the same without
        binding the step per batch.)

        Args:
            data_batch: the batch.
            is_train: train (backward) or only forward.
            total_rows: see ``forward``.
            scale: see ``backward``.
            metric: a ``DeviceMetrics`` to update, or None.
            zero_grad: zero the gradients first (the first batch of an optimizer step).
            optimizer: also take the optimizer step after backward, as ``step`` does with
                ``scaler`` and ``clip_norm``.
            guard: a context the batch runs in when it steps, e.g. ``fitdp.call.interrupts.
                GUARD.critical()``: a Ctrl-C during the step is raised after it.
        """
        bound = self.bind_step(is_train, optimizer=optimizer, scaler=scaler,
                               clip_norm=clip_norm, scale=scale, metric=metric)
        self.group_of(data_batch).set_mode(is_train)  # (a call's session sets its own)
        with guard if guard is not None and optimizer is not None else contextlib.nullcontext():
            bound(data_batch, zero_grad=zero_grad, step=optimizer is not None,
                  total_rows=total_rows)

    def step(self, optimizer: torch.optim.Optimizer, *,
             scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None,
             guard: contextlib.AbstractContextManager[Any] | None = None) -> None:
        """One optimizer step on every replica, from the gradients of the last backward(s).

        The whole sequence, in order: reduce the gradients into device 0 (and across ranks);
        unscale them (``scaler``, 16-mixed); clip their global norm to ``clip_norm``; step
        ``optimizer`` on device 0's parameters; copy device 0's parameters to every other
        device.

        Args:
            optimizer: built on ``named_master_parameters()`` (or ``master_parameters()``).
            scaler: the ``GradScaler`` of a 16-mixed run, or None.
            clip_norm: max global norm of the gradients, or None.
            guard: a context the sequence runs in (see ``run_batch``).
        """
        update = self.update(UpdateOptions(optimizer, scaler, clip_norm))
        with guard if guard is not None else contextlib.nullcontext():
            if update.optimizer is not None:
                update.apply()

    def zero_grad(self) -> None:
        """Zero the gradients on every device."""
        update = self.update(UpdateOptions())
        for d in range(len(self.devices)):
            update.zero_device(d)

    def reduce_gradients(self) -> None:
        """Sum every device's gradients into device 0's (then across ranks)."""
        self.update(UpdateOptions()).reduce_gradients()

    def sync_params(self) -> None:
        """After an optimizer step on device 0, copy its parameters to every other device."""
        self.update(UpdateOptions()).broadcast_params()

    def named_master_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Device 0's parameters by name, frozen ones too: bind the optimizer to these."""
        return {name: block[0] for name, block in zip(self.param_names, self.param_arrays)}

    def master_parameters(self) -> list[torch.nn.Parameter]:
        """Device 0's trainable parameters: the ones the optimizer steps."""
        return [block[0] for block, on in zip(self.param_arrays, self.trainable) if on]

    def set_work_load_list(self, work_load_list: Sequence[float] | str | None) -> None:
        """Each device's share of a batch from now on: a list (see ``split_input_slice``),
        None for equal shares, or ``"auto"``: measured. With ``"auto"`` the steps bound
        from now on time each device's share of every batch (load, forward, backward,
        metrics), set the loads so the devices finish together, and measure again when
        their times drift apart; ``work_load_list`` holds the loads in use, and each change
        is logged (INFO, the ``fitdp`` logger). The update is the whole batch's whatever
        the split."""
        loads = check_work_load_arg(work_load_list, len(self.devices))
        if isinstance(loads, str):  # "auto"
            if self.balancer is None:
                self.balancer = LoadBalancer(len(self.devices))
                self.balancing = Balancing(self.balancer, self.devices)
                self.use_loads(self.balancer.loads, None)
            return
        self.balancer = self.balancing = None
        if loads != self.work_load_list:
            self.use_loads(loads, None)

    def use_loads(self, loads: list[float], seconds: Sequence[float] | None) -> None:
        """Split batches by ``loads`` from now on (``seconds``: the device times that led
        to them, logged)."""
        self.work_load_list[:] = loads  # in place: whoever holds the list sees the loads
        self.row_slices.clear()
        if self._reserved:
            self.reserve(self._reserved)
        if seconds is not None:
            self.logger.info("fitdp: work_load_list='auto' now %s on %s (device times %s ms "
                             "per batch before)", loads, [str(d) for d in self.devices],
                             [round(t * 1e3, 3) for t in seconds])

    def measures(self) -> dict[str, Any] | None:
        """What ``work_load_list="auto"`` has measured so far (its loads and window), plain
        numbers for a checkpoint: a run resumed on the same devices then splits each batch
        as the uninterrupted run does (the split is part of the arithmetic, so this is what
        a bitwise resume needs). None: nothing measured (a list of loads)."""
        if self.balancer is None:
            return None
        return {"devices": len(self.devices), "balancer": self.balancer.state_dict()}

    def load_measures(self, state: Mapping[str, Any]) -> None:
        """Go on from ``measures`` (a resume). Another number of devices measures anew; a
        call with a list of loads keeps its list (no balancer to go on with)."""
        if int(state["devices"]) != len(self.devices):
            return
        if self.balancer is not None and state.get("balancer") is not None:
            self.balancer.load_state_dict(state["balancer"])
            self.use_loads(self.balancer.loads, None)

    # -- internals -------------------------------------------------------------------------

    def _blocks(self, method: str, arg_params: Any, aux_params: Any) -> tuple[_Named, _Named]:
        """Parameters and buffers with the caller's tensors, each name and shape checked."""
        blocks: tuple[_Named, _Named] = (
            (self.param_names, self.param_arrays, arg_params),
            (self.aux_names, self.aux_arrays, aux_params),
        )
        for (names, arrays, given), arg in zip(blocks, ("arg_params", "aux_params")):
            checks.check_named(method, arg, given, names, arrays)
        return blocks

    def _holds(self, arg_params: Any, aux_params: Any) -> bool:
        """Whether the caller's mappings are exactly the one replica's parameters and buffers,
        the same tensor objects under the same names (one device whose replica is the host
        module itself): every name and shape checks, and every copy would be onto itself."""
        if len(self.devices) != 1:
            return False
        blocks: tuple[tuple[list[str], Sequence[Sequence[torch.Tensor]], Any], ...] = (
            (self.param_names, self.param_arrays, arg_params),
            (self.aux_names, self.aux_arrays, aux_params))
        for names, arrays, given in blocks:
            if type(given) is not dict or len(given) != len(names) or any(map(
                    operator.is_not, map(given.get, names), map(_FIRST, arrays))):
                return False
        return True

    def _group(self, modules: list[nn.Module], key: Hashable) -> DataParallelExecutorGroup:
        group = DataParallelExecutorGroup(
            modules, self.devices, self.shared_buffers, self.workers,
            bucket_key=key, compile=self.compile, logger=self.logger,
            inputs_need_grad=self.inputs_need_grad, compile_config=self.compile_config,
        )
        if self.monitor is not None:
            self._install(group)
        return group

    def _bucket_group(self, key: Hashable) -> DataParallelExecutorGroup:
        bases = [ex.module for ex in self.execgrp.executors]
        group = self._group(bucket_replicas(self.bucket_module, key, bases), key)
        self.groups[key] = group
        return group

    def _install(self, group: DataParallelExecutorGroup) -> None:
        bucket = f"b{group.bucket_key}/" if self.bucket_module is not None else ""
        for d, ex in enumerate(group.executors):
            dev = f"d{d}/" if len(self.devices) > 1 else ""
            # Weights and gradients are shared by every bucket: watch them once, on device 0.
            self.monitor.install(ex.module, bucket + dev, params=(group is self.execgrp and d == 0))

    def slices_for(self, rows: int) -> list[slice]:
        """Each device's rows of a batch of ``rows`` (by the work loads in use)."""
        slices = self.row_slices.get(rows)
        if slices is None:
            slices = self.row_slices[rows] = device_slices(rows, self.work_load_list)
        return slices

    def weighing(self) -> Weighing:
        """The weighing of this manager's slices (``fitdp.executor.weighing``), for what
        ``compute`` counts now (a custom step learns it when bound to its model)."""
        counter = getattr(self.compute, "counts", None)
        if self._weighing.counter is not counter:
            self._weighing = Weighing(counter, self.devices, self.distributed)
        return self._weighing
