"""One call on a model's replicas: its steps, logs and data position, rolled back on failure.

``Model.fit``/``evaluate``/``predict`` open a ``Session`` for the length of the call. It
owns what only lives that long (the latest logs, the data position of the last optimizer
step, the first-batch checks) and changes the model's lasting state only through the
``RunState``, the compiled setup's optimizer and the replicas.

Its steps run whole (``fitdp.call.interrupts``): each runs inside ``GUARD``, so a Ctrl-C
lands between steps, never inside one; SIGTERM (a preempted job) is read as a flag between
steps.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fitdp.call.batches import PREDICT, TEST, TRAIN, assemble, run_batches
from fitdp.call.first_batch import check_outputs, raised_in_fitdp
from fitdp.call.interrupts import GUARD, SIGTERM, Preempted
from fitdp.call.modes import Modes
from fitdp.call.monitor import Monitor
from fitdp.call.plan import CallPlan, FitPlan
from fitdp.call.replicas import Replicas
from fitdp.call.restore_points import CallStart, StepStart
from fitdp.call.run_state import RunState
from fitdp.call.throughput import Throughput
from fitdp.callbacks import CallbackList
from fitdp.callbacks.base import is_log_point
from fitdp.checks import FitdpWarning, fail
from fitdp.compiled.losses import explain_failure
from fitdp.compiled.setup import Compiled
from fitdp.data.batch import DataBatch, batch_labels, batch_length, take_rows, tree_cat, tree_map
from fitdp.data.sources import DataSource
from fitdp.executor.checkpointing import ActivationCheckpointing
from fitdp.executor.replica import call_module
from fitdp.executor.reproducible import ReproducibleStep
from fitdp.executor.step import Step
from fitdp.executor.update import StepState
from fitdp.saving.entries import RNG, Entry, EpochLogs, RankStates
from fitdp.saving.fence import fence_steps


class Session:
    """The steps of one call (see the module docstring).

    Args:
        compiled: the compiled setup (None: predict without compile).
        replicas: the manager and metric clones the call runs on.
        run: the model's run state.
        plan: the call's checked arguments.
        modes: every submodule's train/eval mode at the call's start.
    """

    def __init__(self, compiled: Compiled | None, replicas: Replicas, run: RunState,
                 plan: CallPlan, modes: Modes) -> None:
        self.compiled, self.replicas, self.run, self.plan = compiled, replicas, run, plan
        self.mgr = replicas.manager
        self.metrics = replicas.metrics or None  # (no metrics: None, not an empty one)
        self.modes = modes
        self.mode: bool | None = None  # the mode the replicas are in (None: not set yet)
        # A subclass's own step (``fitdp.call.custom_step``); with several optimizers its
        # train_step steps them (``Model.optimizer_step``) and fitdp takes no step itself.
        self.custom = replicas.step
        self.epoch_logs = EpochLogs(self.mgr, self.metrics, run, self.custom, plan.ranks)
        # Each rank's own generators and data position, gathered before rank 0 saves.
        self.rng = RankStates(RNG, plan.ranks, "random generators")
        self.position = RankStates(self.data_position(), plan.ranks, "data positions")
        self.buffers = RankStates(Entry(replicas.own_buffers, replicas.load_own_buffers),
                                  plan.ranks, "BatchNorm statistics", rank0_elsewhere=False)
        self.distributed = plan.ranks.enabled  # (read at every step boundary)
        self.manual = compiled is not None and compiled.manual
        if self.custom is not None and self.custom.meeting is not None:
            self.custom.meeting.reset()  # no failure of an earlier call survives into this one
        self.logs: dict[str, float] = {}
        self.example_inputs: Any = None
        self.log_every = plan.log_every if isinstance(plan, FitPlan) else 50
        self.monitor: Monitor | None = plan.monitor if isinstance(plan, FitPlan) else None
        # Exact batch logs every batch only where reading them costs no device sync, and
        # decided alike on every rank (a read is a collective under torch.distributed).
        cpu = all(d.type == "cpu" for d in replicas.placement.devices)
        cbs = plan.callbacks
        needs = getattr(cbs, "needs_batch_logs", True)
        self.exact_logs = cbs.sync_every_batch or (cpu and not self.distributed and needs)
        # No batch-end hook at all: no logs are read between epoch ends (each read folds
        # the losses and syncs); a hook gets the latest values, never empty. Under
        # torch.distributed a read is a collective, and ranks may hold other callbacks (the
        # progress bar is rank 0's): read as planned.
        listens = cbs.listens("on_train_batch_end") or cbs.listens("on_test_batch_end")
        self.batch_reads = self.exact_logs or listens or self.distributed
        # The log points, known to the callbacks (``is_log_point``): every batch where the
        # logs are exact, else the first and every ``log_every``-th.
        if self.exact_logs:
            self.log_every = 1
        cbs.set_params({**cbs.params, "log_every": self.log_every})
        self.grad_norm = cbs.logs_grad_norm  # "grad_norm" in the training logs
        self.data_state: dict[str, Any] | None = None  # train source at the last step
        self.start = CallStart(run, compiled, plan)  # (put back by ``rollback``)
        # The buffers as each optimizer step found them (put back by ``rollback``).
        self.step_start = StepStart(self.mgr.aux_arrays, replicas.modules()) \
            if isinstance(plan, FitPlan) and self.mgr.aux_arrays else None
        self.watching = False  # SIGTERM is read between training steps (``preemption``)
        self.vote: Any = None  # under torchrun: the flag of the last step boundary, in flight
        self.throughput = Throughput(plan.source)
        self.rates: dict[str, float] = {}  # the last training epoch's (``Throughput``)
        self.checked = False  # the first batch ran (its errors came back with context)
        self.verified = False  # the checks that need the model's outputs are done
        self.scale = compiled.loss_scale() if compiled is not None else None
        # Fixed for the call (compile cannot run during one): read once, not every step.
        config = compiled.config if compiled is not None else None
        self.accum = config.grad_accum_steps if config is not None else 1
        self.clip = config.grad_clip_norm if config is not None else None
        self.step_scheduler = compiled is not None and compiled.scheduler is not None
        if self.monitor is not None:
            self.mgr.install_monitor(self.monitor)
        # Measured loads for this call, or the placement's (replicas kept from an "auto"
        # call measure no more); the model reports the list in use, updated in place.
        self.mgr.set_work_load_list(
            "auto" if plan.auto_loads else list(replicas.placement.work_load_list))
        fence_steps(self.mgr.before_step)  # an async save still copying: the steps wait
        # The steps of the call, chosen once from what the call fixes (Keras's
        # make_train_function): the batch loops below only call them.
        # A profiler's callback, or one running around the call, gets the phases as named
        # ranges; any other call binds steps without range code.
        named = cbs.names_phases or torch.autograd._profiler_enabled()
        # fit(reproducible=True): the reproducible step (``executor/reproducible.py``)
        micro = plan.micro_batch_size if isinstance(plan, FitPlan) else None
        self.test = self.mgr.bind_step(False, metric=self.metrics, named=named,
                                       micro_batch_size=micro)
        inspect = functools.partial(cbs.call, "on_before_optimizer_step") \
            if cbs.listens("on_before_optimizer_step") else None
        self.train = self.mgr.bind_step(
            True, optimizer=compiled.optimizer, scaler=compiled.scaler, clip_norm=self.clip,
            scale=self.scale, metric=self.metrics, named=named, micro_batch_size=micro,
            track_norm=self.grad_norm, inspect=inspect) if compiled is not None else None
        # Last: the blocks' forwards are put back by ``close``, which runs once this is made.
        blocks = config.activation_checkpointing if config is not None else None
        self.checkpointing = ActivationCheckpointing(
            blocks, replicas.modules(), replicas.placement.devices) if blocks else None

    # -- fit ----------------------------------------------------------------------------

    def start_fit(self) -> None:
        """Put the training data at the start of the run (a resume then loads over it)."""
        plan = self.plan
        plan.source.set_epoch(self.run.data_epoch)
        self.data_state = plan.source.state_dict()

    def train_epoch(self) -> dict[str, float] | None:
        """Train one epoch (``steps_per_epoch`` batches, or the data's); return its logs, or
        None when the data ran out before the epoch's first batch: then it is no epoch (the
        run's position is put back, training stops with a warning), so the History holds
        only epochs that trained, each with its loss (Keras's "Your input ran out of data;
        interrupting training", ``keras/src/trainers/epoch_iterator.py``)."""
        run, plan = self.run, self.plan
        assert isinstance(plan, FitPlan)  # noqa: S101 - start_fit ran
        if plan.steps is None and run.batch == 0:
            plan.source.set_epoch(run.epoch)
            run.data_epoch = run.epoch
            self.data_state = plan.source.state_dict()
        self.reset_logs()
        self.epoch_logs.begin()  # resumed mid-epoch: they go on from the checkpoint's
        self.throughput.begin(self.train)  # type: ignore[arg-type]
        done = run_batches(self.throughput.counted(self._epoch_batches()), plan.callbacks,
                           TRAIN, self.train_step, run,
                           self.preempted if self.watching else None)
        self.stop_if_preempted()  # (before the partial step below: the backup is of the last)
        if not done and not run.batch:  # (a resumed epoch trained its batches before)
            if not run.stop_training:  # (``_steps_batches`` warned already)
                self._ran_out(f"before epoch {run.epoch}'s first batch")
            run.undo_epoch()
            return None
        self.epoch_logs.live = False
        if run.micro_step:  # the epoch's last batches, fewer than grad_accum_steps
            with GUARD:
                if not self.manual:
                    self.train.step_now()  # type: ignore[union-attr]
                self._stepped()
        # Same position, read again now the epoch's iterator has ended: a sampler may draw
        # from its generator as it stops (torch's RandomSampler does), and the next epoch's
        # order starts there.
        self.data_state = plan.source.state_dict()
        self.rates = self.throughput.rates(self.train, plan.ranks,  # type: ignore[arg-type]
                                           self.mgr.devices[0])
        logs = self.read_logs()
        if self.grad_norm:
            logs.update(self.state_logs())
        self.mgr.sync_buffers()  # every replica (and the saved model) gets the same BN stats
        return logs

    def _epoch_batches(self) -> Iterator[DataBatch]:
        """This epoch's batches: the rest of the data, or the next ``steps_per_epoch``
        batches of a stream that starts the data's next epoch when one ends (Keras)."""
        plan = self.plan
        assert isinstance(plan, FitPlan)  # noqa: S101
        return iter(plan.source) if plan.steps is None else self._steps_batches()

    def _steps_batches(self) -> Iterator[DataBatch]:
        """The next ``steps_per_epoch`` batches, going on into the data's next epochs."""
        run, plan = self.run, self.plan
        assert isinstance(plan, FitPlan) and plan.steps is not None  # noqa: S101
        left, fresh = plan.steps - run.batch, False
        while left > 0:
            got = 0
            for batch in itertools.islice(plan.source, left):
                got += 1
                yield batch
            left -= got
            if left > 0:
                if fresh and got == 0:  # a new pass of the data yielded nothing
                    self._ran_out("before steps_per_epoch batches")
                    return
                run.data_epoch += 1
                plan.source.set_epoch(run.data_epoch)
                fresh = True

    def _ran_out(self, where: str) -> None:
        """Stop training: the data yielded no batch when one was due (``where``)."""
        warnings.warn(
            f"x: the data ran out {where}, and training stops (Keras does the same). Fix: "
            "make it yield at least steps_per_epoch * epochs batches (an endless generator "
            "does), or batches again on each pass.", FitdpWarning, stacklevel=3)
        self.run.stop_training = True

    def train_step(self, batch: DataBatch, index: int) -> dict[str, float]:
        """Forward and backward of one batch; an optimizer step every ``grad_accum_steps``
        batches. Runs whole: a Ctrl-C during it is raised after it."""
        run = self.run
        # The step's one guard (the bound step holds none); the call holds the handler
        # installed (``fitdp.model.facade``), so entering it is all a step pays.
        with GUARD:
            if self.mode is not True:
                self._set_mode(True)
            monitor = self.monitor
            if monitor is not None:
                monitor.tic()
            # Zeroed as the step begins, not after it: gradients stay readable until the
            # next step begins (monitors, callbacks).
            first = run.micro_step == 0
            due = run.micro_step + 1 >= self.accum
            if first and self.step_start is not None:
                self.step_start.save(run.global_step)
            # Stepped inside the batch's hand-off, except on the call's first batch: its
            # outputs are checked before the first step. With several optimizers a custom
            # train_step steps them itself (``Model.optimizer_step``): fitdp takes none.
            stepping = due and self.verified and not self.manual
            if self.checked:
                self.train(batch, zero_grad=first, step=stepping,  # type: ignore[misc]
                           total_rows=batch.global_rows)
            else:
                self._first_batch(self.train, batch, first, stepping)  # type: ignore[arg-type]
            if not self.verified:
                self._first_batch_checks(batch)
                if isinstance(self.train, Step):  # the checks were the outputs' last reader
                    self.train.keep_outputs = self.train.metric is not None
                if due and not self.manual:
                    self.train.step_now()  # type: ignore[union-attr]
            run.micro_step += 1
            if due:
                self._stepped()
            if monitor is not None:
                monitor.report(run.epoch)
        if not self.batch_reads:
            return dict(self.logs)
        if self.grad_norm and is_log_point(index, self.log_every):  # kept as the loss is
            self.logs = {**self._batch_logs(index), **self.state_logs()}
            return dict(self.logs)
        return self._batch_logs(index)

    # -- preemption ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def preemption(self) -> Iterator[None]:
        """Read SIGTERM between this fit's training steps (``stop_if_preempted``). Under
        torchrun only when the call has a backup to write (a ``BackupAndRestore``): the
        ranks then agree, so a signal to one stops all after the same step; one all-reduce
        of one number per step, paid only then."""
        ranks = self.plan.ranks
        if ranks.enabled and not self._backups():
            yield  # SIGTERM ends each rank as it always did
            return
        with SIGTERM.installed() as on:
            self.watching = on
            try:
                yield
                self._end_vote()
            except Preempted:
                self._end_vote()
                raise
            finally:
                self.watching, self.vote = False, None

    def preempted(self) -> bool:
        """Whether SIGTERM came (on any rank), read at a step boundary. Under torchrun the
        ranks agree one boundary late: each boundary's flag is all-reduced while the next
        step runs (its latency hidden behind the step), and every rank reads the same
        answer at the same boundary."""
        if not self.watching:
            return False
        if not self.distributed:
            return SIGTERM.requested
        ranks = self.plan.ranks
        earlier, self.vote = self.vote, ranks.vote(SIGTERM.requested)
        return earlier is not None and ranks.tally(earlier)

    def _end_vote(self) -> None:
        """Wait for the vote in flight (every rank started it) before the call ends."""
        if self.vote is not None:
            self.plan.ranks.tally(self.vote)
            self.vote = None

    def stop_if_preempted(self) -> None:
        """After SIGTERM: every ``BackupAndRestore`` writes its backup of the model as of
        the last optimizer step, and ``fitdp.Preempted`` is raised.

        Raises:
            Preempted: SIGTERM came (on any rank).
        """
        if not self.preempted():
            return
        backups = self._backups()
        for cb in backups:
            cb.backup_now()
        where = ", ".join(cb.path for cb in backups) or "no BackupAndRestore: nothing saved"
        message = (f"fit: preempted (SIGTERM) after optimizer step {self.run.global_step}; "
                   f"backup: {where}. Run the same script again to resume from it.")
        if self.plan.ranks.is_main:
            print(message, file=sys.stderr, flush=True)
        raise Preempted(message)

    def _backups(self) -> list[Any]:
        """The call's callbacks that keep a backup to resume from (``backup_now()``)."""
        return [cb for cb in self.plan.callbacks.callbacks
                if callable(getattr(cb, "backup_now", None))]

    def _stepped(self) -> None:
        """What follows an optimizer step: the scheduler, the counters, the data position."""
        if self.step_scheduler:
            self.compiled.step_scheduler("step")  # type: ignore[union-attr]
        run = self.run
        run.global_step += 1
        run.batch += run.micro_step  # the batches this step took
        run.micro_step = 0
        self.data_state = self.plan.source.state_dict()
        if self.accum > 1:  # a checkpoint between steps saves the logs of this step
            self.epoch_logs.mark()

    def step_losses(self) -> Generator[float, None, None]:
        """Train the planned batches (``steps_per_epoch``, going on into the data's next
        epochs) without callbacks, yielding after each optimizer step the mean loss of the
        batches it took (``model.find_lr``'s sweep: it sets the rate before each step and
        stops early by closing the iterator)."""
        self.reset_logs()
        for i, batch in enumerate(self._epoch_batches()):
            self.train_step(batch, i)
            if self.run.micro_step == 0:
                yield self.read_logs()["loss"]
                self.reset_logs()

    def end_epoch(self, logs: dict[str, float]) -> None:
        """Record the rate this epoch trained with, then step a per-epoch scheduler."""
        assert self.compiled is not None  # noqa: S101
        logs.update(self.compiled.learning_rates)
        self.compiled.step_scheduler("epoch")
        self.run.epoch_done = True

    @torch.no_grad()
    def update_bn(self) -> None:
        """``torch.optim.swa_utils.update_bn`` for the current weights: BatchNorm statistics
        reset, then one pass over the training data in training mode with cumulative
        averages (``momentum=None``). The whole batches run on device 0's replica, so the
        statistics are the one-device ones whatever the device count; the other replicas
        (and, averaged, the other ranks) then take them. Data the pass cannot read again (a
        one-shot iterator) leaves the statistics as they were."""
        plan, mgr = self.plan, self.mgr
        assert isinstance(plan, FitPlan)  # noqa: S101 - fit's own
        module = self.replicas.modules()[0]
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:
            return
        saved = [t.clone() for block in mgr.aux_arrays for t in block[:1]]
        modes = [(m, m.training) for m in module.modules()]
        momenta = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        module.train()
        device = self.replicas.placement.devices[0]
        plan.source.set_epoch(self.run.data_epoch)
        seen = 0
        for batch in itertools.islice(plan.source, plan.steps):
            rows = batch_length(batch.data, batch.axis) - batch.pad
            data = take_rows(batch.data, slice(0, rows), batch.axis) if batch.pad else batch.data
            call_module(module, tree_map(lambda t: t.to(device, non_blocking=True), data))
            seen += 1
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
        for sub, training in modes:
            sub.training = training
        first = {name: block[0] for name, block in zip(mgr.aux_names, mgr.aux_arrays)}
        if not seen:
            for t, old in zip(first.values(), saved):
                t.copy_(old)
            warnings.warn("update_bn: the training data yielded no batch on a second pass (a "
                          "one-shot iterator); the BatchNorm statistics stay the training "
                          "run's. Fix: pass data that can be iterated again, or run "
                          "torch.optim.swa_utils.update_bn(loader, model.module) after fit.",
                          FitdpWarning, stacklevel=2)
        mgr.set_params({}, first)  # every replica takes device 0's statistics
        if plan.ranks.enabled:
            mgr.sync_buffers()  # averaged over the ranks, each of which saw its shard

    # -- evaluate and predict -----------------------------------------------------------

    def test_pass(self, source: DataSource, callbacks: CallbackList, steps: int | None
                  ) -> dict[str, float]:
        """Loss and metrics over ``source`` from its start (``steps`` batches at most)."""
        self.run.stop_evaluating = False
        self.reset_logs()
        source.set_epoch(0)
        callbacks.call("on_test_begin", {})

        def step(batch: DataBatch, index: int) -> dict[str, float]:
            self._one_batch(self.test, batch)
            if index == 0:
                self._check_own_loss(source, batch)
            if not self.verified:
                self._first_batch_checks(batch)
            return self._batch_logs(index)

        run_batches(itertools.islice(source, steps), callbacks, TEST, step, self.run)
        logs = self.read_logs()
        callbacks.call("on_test_end", logs)
        return logs

    def predict_pass(self, source: DataSource, callbacks: CallbackList, steps: int | None,
                     pad_value: float | None = None, ragged: bool = False) -> Any:
        """Outputs for every sample of ``source``, in input order, on the CPU (see
        ``loop.assemble`` for ``pad_value`` and ``ragged``)."""
        self.run.stop_predicting = False
        source.set_epoch(0)
        rows: list[tuple[int, Any, Any]] = []
        axes: list[Any] = []  # per batch, each output's batch axis
        kinds: list[type | None] = []  # per batch, the outputs' class (a ModelOutput)
        to_host = _host_copier(self.replicas)

        def step(batch: DataBatch, index: int) -> dict[str, float]:
            if self.custom is not None:  # forward runs predict_step during this pass
                self.custom.predicting = True
            try:
                self._one_batch(self.test, batch)
            finally:
                if self.custom is not None:
                    self.custom.predicting = False
            outs = [tree_map(to_host, o) for o in self.mgr.outputs()]
            if outs:
                axes.append(self.mgr.output_axes())
                kinds.append(self.mgr.output_type())
            rows.append((index, batch.index, tree_cat(outs, axes[-1]) if outs else None))
            return {}

        callbacks.call("on_predict_begin", {})
        run_batches(itertools.islice(source, steps), callbacks, PREDICT, step, self.run)
        callbacks.call("on_predict_end", {})
        same = bool(axes) and all(a == axes[0] for a in axes)
        return assemble(rows, self.plan.ranks, axes[0] if same else 0, pad_value, ragged,
                        kinds[0] if kinds else None)

    # -- shared by every call -------------------------------------------------------------

    def _one_batch(self, bound: Step | ReproducibleStep, batch: DataBatch) -> None:
        """One batch through one of the call's bound steps without an optimizer step (the
        training steps: ``train_step``)."""
        if self.mode is not bound.is_train:
            self._set_mode(bound.is_train)
        if self.checked:
            bound(batch, total_rows=batch.global_rows)
        else:
            self._first_batch(bound, batch)

    def _first_batch(self, bound: Step | ReproducibleStep, batch: DataBatch,
                     zero_grad: bool = False, step: bool = False) -> None:
        """A call's first batch through one of its bound steps (``zero_grad``, ``step``: its
        zeroing and optimizer step), checked first; the user's errors come back with what
        the batch held."""
        compiled = self.compiled
        own = getattr(compiled.objective, "check_first_batch", None) if compiled else None
        if own is not None:  # compile(loss=None)
            module = self.replicas.modules()[0] if self.custom is None else None
            own(batch.data, batch.label, module, bound.is_train)
        custom_rows = getattr(compiled.objective, "warn_custom_step_rows", None) \
            if compiled is not None and self.custom is not None else None
        several = len(self.mgr.devices) > 1 or self.plan.ranks.enabled
        if custom_rows is not None and bound.is_train and several and batch.label is not None:
            custom_rows(batch.label)
        forward = self.plan.forward
        if forward is not None and self.custom is None:
            forward.check_keys(batch.data, compiled.forward_kwargs if compiled else None)
        if compiled is not None and batch.label is not None and self.custom is None:
            compiled.objective.check_targets(batch.label)
            if batch.sample_weight is not None and not compiled.objective.supports_sample_weight:
                raise ValueError(compiled.objective.no_weights_message())
        if isinstance(bound, Step) and bound.is_train:  # outputs kept for a reader only
            bound.keep_outputs = bound.metric is not None or self._checks_outputs(batch)
        try:
            self.checked = True
            bound(batch, zero_grad=zero_grad, step=step, total_rows=batch.global_rows)
        except Exception as err:
            self.checked = False
            if raised_in_fitdp(err):
                raise
            raise explain_failure(err, batch, "x") from err

    def _check_own_loss(self, source: DataSource, batch: DataBatch) -> None:
        """After a test pass's first batch under ``compile(loss=None)``, when it held no
        labels: the module returned a loss (else the result would be empty, ``{}``).

        Raises:
            ValueError: naming the data (``x`` or ``validation_data``).
        """
        compiled = self.compiled
        if compiled is None or self.custom is not None or not hasattr(
                compiled.objective, "loss_of") or batch_labels(batch.data,
                                                               batch.label) is not None:
            return
        if not float(self.mgr.loss_state()[1]):  # (a host read, only for such a batch)
            name = "validation_data" if source is getattr(self.plan, "val", None) else "x"
            fail(name, "batches the module computed no loss for (no labels in them)",
                 "batches that hold the labels the module's own loss needs "
                 "(compile(loss=None))", "put 'labels' in each batch (a Hugging Face "
                 "collator does), or use predict for outputs without a loss",
                 described=True)

    def _set_mode(self, training: bool) -> None:
        """Every replica in a ``training`` pass's modes (``fitdp.call.modes``), once per pass."""
        self.modes.apply(self.replicas.modules(), training)
        self.mode = training

    def _first_batch_checks(self, batch: DataBatch) -> None:
        """Checks that need the model's outputs, made once per call before the first
        optimizer step: every target in range (the whole in-memory label tensor), and the
        validation data shaped like the training data."""
        self.verified = True  # and one CPU row kept for summary()'s output shapes:
        self.example_inputs = tree_map(lambda t: t.to("cpu", copy=True), take_rows(
            batch.data, slice(0, 1), batch.axis))
        compiled = self.compiled
        if compiled is None or not self._checks_outputs(batch):
            return  # (a custom step's outputs and targets are the step's own to check)
        outputs = self.mgr.outputs()
        if not outputs:
            return
        check_outputs(compiled.objective, outputs[0], batch, self.plan.source,
                      getattr(self.plan, "val", None))

    def state_logs(self) -> dict[str, float]:
        """What the last optimizer step saw that the callbacks asked for (``grad_norm``),
        read on the host: one sync, at a log point; {} before the call's first step."""
        state = self.step_state
        norm = state.grad_norm if state is not None else None
        if norm is None:
            return {}
        whole = getattr(norm, "full_tensor", None)  # FSDP2: a sharded norm, all-reduced
        return {"grad_norm": float(whole() if whole is not None else norm)}

    @property
    def step_state(self) -> StepState | None:
        """The training step's view of its last optimizer step (``StepState``), or None
        without one (evaluate, predict, no optimizer)."""
        update = getattr(self.train, "update", None)
        return update.state if update is not None else None

    def _checks_outputs(self, batch: DataBatch) -> bool:
        """Whether the first-batch checks read this call's outputs (compile's loss on
        separate targets: a model's own loss on a dict batch needs no check)."""
        return self.compiled is not None and batch.label is not None and self.custom is None

    def _batch_logs(self, index: int) -> dict[str, float]:
        if self.exact_logs or (self.batch_reads and is_log_point(index, self.log_every)):
            self.logs = self.read_logs()  # a host sync: only at log points on GPU
        return dict(self.logs)

    def read_logs(self) -> dict[str, float]:
        """Mean loss and every metric since the last reset (the one host sync)."""
        total, count = self.mgr.loss_state()
        if self.distributed:
            total, count = self.plan.ranks.all_reduce_sum(torch.stack([total, count]))
        rows = float(count)
        logs = {"loss": float(total) / rows} if rows else {}
        if self.custom is not None:
            logs.update(self._step_logs())
        if self.metrics:
            logs.update(self.metrics.compute())
        return logs

    def _step_logs(self) -> dict[str, float]:
        """The other logs a custom step returned, each the mean over the samples (and
        ranks) since the last reset."""
        extra = self.custom.logs()  # type: ignore[union-attr]
        if self.distributed and extra:
            sums = self.plan.ranks.all_reduce_sum(torch.tensor(
                [v for key in sorted(extra) for v in extra[key]], dtype=torch.float64))
            extra = {key: [float(sums[2 * i]), float(sums[2 * i + 1])]
                     for i, key in enumerate(sorted(extra))}
        return {key: total / rows for key, (total, rows) in extra.items() if rows}

    def reset_logs(self) -> None:
        self.mgr.reset_loss()
        if self.custom is not None:
            self.custom.reset_logs()
        if self.metrics:
            self.metrics.reset()
        self.logs = {}

    def data_position(self) -> Entry:
        """The training data's position at the last optimizer step, as a checkpoint entry;
        checked by the source (``check_resume``) before a resume changes anything. The
        session keeps it (``position``): its functions hold the session weakly, or the cycle
        would keep a finished call's model and worker threads alive until a collection."""
        me = weakref.ref(self)

        def save() -> dict[str, Any] | None:
            return me().data_state  # type: ignore[union-attr]

        def load(state: dict[str, Any]) -> None:
            session: Session = me()  # type: ignore[assignment]
            session.plan.source.load_state_dict(state)
            session.data_state = state

        def check(state: Any, checkpoint: Mapping[str, Any]) -> str | None:
            session: Session = me()  # type: ignore[assignment]
            source_check = getattr(session.plan.source, "check_resume", None)
            if source_check is None:
                return None
            return source_check(state, continues=session._continues(checkpoint["run"]))

        return Entry(save, load, check)

    def _continues(self, run: Mapping[str, Any]) -> bool:
        """Whether a fit resumed at ``run`` (a checked run state) reads its data on from the
        saved position: an epoch left in the middle, or any with ``steps_per_epoch`` (the
        data runs on across epochs); else the next epoch starts the data afresh."""
        plan = self.plan
        assert isinstance(plan, FitPlan)  # noqa: S101 - a resume is a fit's
        next_epoch = run["epoch"] + 1 if run["epoch_done"] else run["epoch"]
        if next_epoch >= plan.epochs:
            return False
        return plan.steps is not None or (not run["epoch_done"] and run["batch"] > 0)

    def rollback(self, error: BaseException) -> None:
        """After ``error``: drop the gradients and the position of batches not stepped, and
        give the buffers (``StepStart``) and the user's data source back as the last optimizer
        step left them; a call that took no optimizer step (and loaded no checkpoint's) is
        put back as it started (``CallStart``). Then the callbacks' ``on_exception``."""
        self.mgr.zero_grad()
        self.run.micro_step = 0
        if self.step_start is not None:  # the buffers a failed step's forwards moved
            self.step_start.restore(self.run.global_step)
        if self.run.global_step == self.start.run.global_step:
            self.start.restore()
        elif self.plan.user_source and self.data_state is not None:
            self.plan.source.load_state_dict(self.data_state)
        try:
            self.plan.callbacks.call("on_exception", error)
        except Exception as hook_err:  # noqa: BLE001 - the call's own error is raised
            warnings.warn(f"a callback's on_exception failed too: {hook_err!r}",
                          FitdpWarning, stacklevel=3)

    def close(self) -> None:
        if self.checkpointing is not None:
            self.checkpointing.remove()
        if self.monitor is not None:
            self.monitor.remove()
            self.mgr.monitor = None


def _host_copier(replicas: Replicas) -> Callable[[torch.Tensor], torch.Tensor]:
    """Outputs to the CPU; under mixed precision, floats in the module's own dtype (as Keras
    returns its compute dtype: float32 for a float32 model trained with bf16-mixed)."""
    compiled = replicas.compiled
    dtype = None
    if compiled is not None and compiled.autocast_dtype is not None:
        params = replicas.manager.master_parameters() or [
            p for row in replicas.manager.param_arrays for p in row[:1]]
        dtype = next((p.dtype for p in params if p.is_floating_point()), None)

    def to_host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            return t.to("cpu", dtype=dtype, copy=True)
        return t.to("cpu", copy=True)

    return to_host
