"""``fitdp.Model``: compile / fit / evaluate / predict over the data-parallel executor manager."""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.call.custom_step import CustomStep
from fitdp.call.host import HostTree
from fitdp.call.interrupts import GUARD, Preempted
from fitdp.call.modes import Modes
from fitdp.call.monitor import Monitor
from fitdp.call.plan import CallPlan, FitPlan, legacy_data, plan_call, plan_fit
from fitdp.call.ranks import DEFAULT_TIMEOUT
from fitdp.call.replicas import Placement, Replicas
from fitdp.call.run_state import RunState
from fitdp.call.session import Session
from fitdp.callbacks import Callback, History, WeightAveraging
from fitdp.checks import FitdpWarning, fail
from fitdp.compiled.metrics import MetricsArg
from fitdp.compiled.optimizers import OptimizerArg
from fitdp.compiled.setup import CompileArgs, Compiled
from fitdp.data.sequence import check_pad_args
from fitdp.executor.checks import check_bucket_module
from fitdp.executor.devices import DevicesArg
from fitdp.executor.engines import Strategy
from fitdp.executor.update import StepState
from fitdp.model.extras import ModelExtras, keras_logs
from fitdp.model.lr_finder import LRFinding
from fitdp.model.saving import ModelIO
from fitdp.model.steps import KerasSteps
from fitdp.saving.async_writer import AsyncCheckpointWriter


class Model(KerasSteps, ModelIO, ModelExtras, LRFinding):
    """A Keras-style facade over a ``torch.nn.Module``, trained data-parallel.

    Args:
        module: the network. Between calls it holds the trained, device-averaged weights.
        bucket_module: ``callable(bucket_key) -> nn.Module`` for variable-length data; the
            module it returns shares every parameter and buffer by name with ``module``.

    The model's run state (epoch, steps, stop flags) is ``model.run``; its worker threads
    are released by ``close()``, at the end of a ``with`` block, or when it is collected.
    A subclass may override Keras 3's ``train_step``, ``test_step``, ``predict_step`` and
    ``compute_loss`` (run per device slice on its replica, ``docs/custom-fit.md``).

    Example:
        >>> net = nn.Linear(4, 3)
        >>> model = Model(net)
        >>> model.compile(optimizer="sgd", loss="cross_entropy")
        >>> h = model.fit(torch.randn(64, 4), torch.randint(0, 3, (64,)), epochs=2, verbose=0)
        >>> len(h.history["loss"])
        2
    """

    def __init__(
        self, module: nn.Module, *, bucket_module: Callable[[Any], nn.Module] | None = None
    ) -> None:
        if not isinstance(module, nn.Module):
            fail("module", module, "a torch.nn.Module", error=TypeError)
        check_bucket_module(bucket_module)
        self.module = module
        self.bucket_module = bucket_module
        self.run = RunState()
        self.is_main_process = True
        self.history: History | None = None
        # The last training epoch's samples_per_sec (and tokens_per_sec): History.throughput
        # and the progress bar read it at on_epoch_end (not in the logs: those are Keras's).
        self.throughput: dict[str, float] = {}
        self._compiled: Compiled | None = None
        self._replicas: Replicas | None = None
        self._session: Session | None = None
        self._writer: AsyncCheckpointWriter | None = None  # async saves, made on first use
        self.example_inputs: Any = None  # one CPU row of the last call's inputs (summary)

    # -- what callbacks and users read ------------------------------------------------------

    stop_training = property(lambda self: self.run.stop_training,
                             lambda self, v: setattr(self.run, "stop_training", bool(v)),
                             doc="Set by a callback to end fit after the current batch.")
    stop_evaluating = property(lambda self: self.run.stop_evaluating,
                               lambda self, v: setattr(self.run, "stop_evaluating", bool(v)))
    stop_predicting = property(lambda self: self.run.stop_predicting,
                               lambda self, v: setattr(self.run, "stop_predicting", bool(v)))
    global_step = property(lambda self: self.run.global_step,
                           doc="Optimizer steps done over the model's life.")

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer (exists right after ``compile``; None for a module without
        parameters)."""
        return self._compiled.optimizer if self._compiled is not None else None

    @property
    def work_load_list(self) -> list[float] | None:
        """Each device's share of a batch on the replicas in use (measured with
        ``work_load_list="auto"``), or None before the first call."""
        return self._replicas.manager.work_load_list if self._replicas is not None else None

    @property
    def shards_weights(self) -> bool:
        """Whether the replicas in use shard the weights across ranks (``strategy="fsdp"``):
        saving then gathers them, a collective every rank must join."""
        return self._replicas is not None and self._replicas.shards_weights

    @property
    def step_state(self) -> StepState | None:
        """During ``fit``, what its last optimizer step saw, read-only and on the device
        (``grad_norm`` before clipping when a callback logs it or the fit clips,
        ``skipped`` for an inf gradient under 16-mixed, ``lr``, ``steps``); None outside
        ``fit``. Reading a tensor of it as a number syncs with the device: do it at log
        points (``Callback.params["log_every"]``)."""
        session = self._session
        return session.step_state if session is not None else None

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler of ``compile(lr_scheduler=...)``, or None."""
        return self._compiled.scheduler if self._compiled is not None else None

    # -- compile, fit, evaluate, predict ------------------------------------------------------

    def compile(
        self,
        optimizer: OptimizerArg = "adam",
        loss: Any = "cross_entropy",
        metrics: MetricsArg = None,
        *keras_order: Any,
        lr: float | None = None,
        lr_scheduler: Any = None,
        precision: str = "32",
        grad_clip_norm: float | None = None,
        grad_accum_steps: int = 1,
        compile: bool | str = False,
        sync_batchnorm: bool = False,
        loss_weights: Sequence[float] | dict[str, float] | None = None,
        strategy: Strategy = "auto",
        weighted_metrics: MetricsArg = None,
        loss_items: str | Callable[[Any], Any] | None = None,
        forward_kwargs: dict[str, Any] | None = None,
        activation_checkpointing: Sequence[type[nn.Module]] | None = None,
    ) -> None:
        """Choose the optimizer, loss and metrics (see docs/api.md); resets the optimizer state.

        ``loss`` may be a list or dict of losses for a module with several outputs, summed
        with ``loss_weights``; Keras's loss and metric names work too, on logits (see
        ``docs/metrics.md``). ``metrics`` may give a list per output (a dict of lists, or a
        list of lists); ``weighted_metrics`` (Keras names) are updated with the sample and
        class weights. ``compile``: True or a ``torch.compile`` mode such as
        ``"reduce-overhead"`` (CUDA graphs). ``sync_batchnorm``: under torch.distributed on
        CUDA, BatchNorm
        layers become ``torch.nn.SyncBatchNorm``. ``strategy``: how ranks share the work under
        torchrun, ``"auto"`` (DDP when each rank drives one device, else fitdp's own
        reduction), ``"ddp"``, ``"fsdp"`` (FSDP2), or ``fitdp.DDP(...)``/``fitdp.FSDP(...)``
        with options (docs/distributed.md). ``loss=None``: the module's own loss
        (``outputs.loss``, a Hugging Face model given labels); ``loss_items`` says what that
        loss averages over (``"tokens"``, ``"causal_lm"`` or a callable, so that several
        devices train the one-device update); ``forward_kwargs`` are passed to every forward
        (e.g. ``{"use_cache": False}``; docs/huggingface.md). ``activation_checkpointing``: a
        list of block classes (``[nn.TransformerEncoderLayer]``) whose activations every
        replica recomputes in backward instead of keeping them (non-reentrant
        ``torch.utils.checkpoint``; docs/precision.md). Every argument is checked and every
        piece built before anything changes.

        The third positional argument is ``metrics`` (Keras's is ``loss_weights``): numbers
        there, or a fourth positional argument (Keras's ``metrics``), are a ``TypeError``
        that names the keywords to use.
        """
        if keras_order:
            fail("compile", f"{3 + len(keras_order)} positional arguments", "at most 3: "
                 "optimizer, loss, metrics (Keras's compile takes loss_weights third and "
                 "metrics fourth)", "pass loss_weights=..., metrics=... and "
                 "weighted_metrics=... by keyword", error=TypeError, described=True)
        if self._session is not None:
            raise RuntimeError("compile: called during fit/evaluate/predict (from a callback);"
                               " compile before or after the call")
        compiled = Compiled.build(self.module, CompileArgs(
            optimizer, loss, metrics, lr, lr_scheduler, precision, grad_clip_norm,
            grad_accum_steps, compile, sync_batchnorm, loss_weights, strategy=strategy,
            weighted_metrics=weighted_metrics, loss_items=loss_items,
            forward_kwargs=forward_kwargs,
            activation_checkpointing=activation_checkpointing))
        self._release()
        self._compiled = compiled

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: int | str = "auto", callbacks: Sequence[Callback] | None = None,
            validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
            class_weight: dict[int, float] | None = None, sample_weight: Any = None,
            initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int | Sequence[int] = 1, *, devices: DevicesArg = "auto",
            work_load_list: Sequence[float] | str | None = None, seed: int | None = None,
            monitor: Monitor | None = None, resume: Any = None, log_every: int = 50,
            timeout: float = DEFAULT_TIMEOUT, reproducible: bool = False,
            micro_batch_size: int | None = None,
            collate_fn: Callable[[list[Any]], Any] | None = None,
            group_by_length: bool | str | Sequence[int] = False, **legacy: Any) -> History:
        """Train for ``epochs`` epochs; returns the ``History`` (see docs/api.md and Keras's fit).

        The arguments up to ``validation_freq`` may be given by position, in Keras's order
        (``fit(x, y, 32, 2)``: batch size 32, 2 epochs); fitdp's own are keyword-only.
        ``seed`` fixes the data order and torch's generator (dropout) for this fit: the same
        seed gives bit-for-bit the same run on the same devices. ``log_every``: batches
        between host reads of loss and metrics on GPU. ``timeout``: seconds a collective may
        wait under torch.distributed before every rank fails. ``reproducible=True`` with
        ``micro_batch_size=k``: weights, optimizer state, logs and predictions bitwise the
        same on any devices, work loads and world size (the global batch fixed), at a cost
        (docs/reproducible.md). ``collate_fn``: how the rows of a ``Dataset``, a list of rows
        or a Hugging Face ``datasets.Dataset`` become one batch, for ``x`` and
        ``validation_data`` (``Trainer(data_collator=)``: a ``DataCollatorWithPadding``, or
        any callable; docs/huggingface.md). ``group_by_length``: batch rows of similar length
        together (``Trainer``'s ``group_by_length``), so the collator pads little: True
        reads each row's length from its ``length`` column, else its ``input_ids``; a column
        name, or one length per row (docs/huggingface.md).
        """
        compiled = self._require_compiled("fit")
        compiled.trainable(self.module)
        plan = plan_fit(
            self, legacy_data(x, legacy, "fit"), y, sample_weight, batch_size=batch_size,
            epochs=epochs, verbose=verbose, callbacks=callbacks,
            validation_split=validation_split, validation_data=validation_data,
            shuffle=shuffle, class_weight=class_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
            devices=devices, work_load_list=work_load_list, seed=seed, monitor=monitor,
            resume=resume, log_every=log_every, timeout=timeout, reproducible=reproducible,
            micro_batch_size=micro_batch_size, collate_fn=collate_fn,
            group_by_length=group_by_length)
        run, cbs = self.run, plan.callbacks
        self._trained_on = plan.source.plan()  # export's batch and sequence axes
        self._averaging = next((cb for cb in cbs if isinstance(cb, WeightAveraging)), None)
        with self._call(plan, compiled) as session, session.preemption():
            run.begin_fit(initial_epoch)
            session.start_fit()
            saved = self._resume(plan.resume) if plan.resume else None
            if saved is None and seed is not None:
                torch.manual_seed(seed)  # dropout masks: reproducible with the seed
            logs: dict[str, float] = {}
            cbs.call("on_train_begin", logs)
            if saved is not None:
                cbs.load_state_dict(saved.get("callbacks") or {})
                session.rng.load_state_dict(saved["rng"])  # last: nothing above may draw
            for epoch in range(run.next_epoch, plan.epochs):
                run.begin_epoch(epoch)
                cbs.call("on_epoch_begin", epoch, {})
                trained = session.train_epoch()
                if trained is None:  # the data ran out as the epoch began: no epoch
                    break
                logs = trained
                self.throughput = dict(session.rates)
                if plan.validates(epoch):
                    val = session.test_pass(plan.val, cbs, plan.val_steps)  # type: ignore[arg-type]
                    logs.update({f"val_{k}": v for k, v in val.items()})
                session.end_epoch(logs)
                cbs.call("on_epoch_end", epoch, logs)
                session.stop_if_preempted()  # SIGTERM: backups written, Preempted raised
                if run.stop_training:
                    break
            if self._replicas is not None:  # every rank: rank 0 alone may save from now on
                self._replicas.share_optimizer()
            cbs.call("on_train_end", logs)
            self.wait_for_saves()
        self.history = cbs.history
        return cbs.history

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: int | str = "auto", sample_weight: Any = None,
                 steps: int | None = None, callbacks: Sequence[Callback] | None = None,
                 return_dict: bool = True, *, devices: DevicesArg = "auto",
                 work_load_list: Sequence[float] | str | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, **legacy: Any
                 ) -> dict[str, float] | list[float] | float:
        """Loss and every metric over the data, from its start: ``{"loss": ...,
        "<metric>": ...}`` (exact over every rank under torch.distributed). With
        ``return_dict=False``, Keras's form: the loss alone, or ``[loss, *metrics]``.
        ``collate_fn`` as in ``fit``."""
        compiled = self._require_compiled("evaluate")
        plan = plan_call(self, legacy_data(x, legacy, "evaluate"), y, sample_weight,
                         batch_size=batch_size, verbose=verbose, callbacks=callbacks,
                         steps=steps, devices=devices, has_labels=True,
                         work_load_list=work_load_list, collate_fn=collate_fn)
        with self._call(plan, compiled) as session:
            logs = session.test_pass(plan.source, plan.callbacks, plan.steps)
        return keras_logs(logs, compiled, return_dict)

    def predict(self, x: Any = None, batch_size: int | None = None, verbose: int | str = 0,
                steps: int | None = None, callbacks: Sequence[Callback] | None = None, *,
                devices: DevicesArg = "auto", work_load_list: Sequence[float] | str | None = None,
                pad_value: float | None = None, ragged: bool = False,
                collate_fn: Callable[[list[Any]], Any] | None = None, **legacy: Any) -> Any:
        """Outputs for every sample, one row per input sample, in input order, on the CPU
        (under torch.distributed: all rows, on every rank). Needs no compile. Outputs of
        several lengths (a per-token tagger over buckets) are padded at their end with
        ``pad_value`` to the longest (None: 0.0, or -100 for a transformers ``ModelOutput``,
        as Trainer pads predictions); ``ragged=True`` returns a list of per-sample outputs.
        A module's ``ModelOutput`` comes back as its class, the per-row fields joined.
        ``collate_fn`` as in ``fit``."""
        check_pad_args(pad_value, ragged)
        plan = plan_call(self, legacy_data(x, legacy, "predict"), None, None,
                         batch_size=batch_size, verbose=verbose, callbacks=callbacks,
                         steps=steps, devices=devices, has_labels=False,
                         work_load_list=work_load_list, collate_fn=collate_fn)
        with self._call(plan, self._compiled) as session:
            return session.predict_pass(plan.source, plan.callbacks, plan.steps,
                                        pad_value=pad_value, ragged=ragged)

    def update_bn(self) -> None:
        """From a callback during ``fit``: BatchNorm running statistics of the current weights
        over the fit's training data, as ``torch.optim.swa_utils.update_bn`` computes them
        (``SWA`` calls it when fit ends). The whole batches run on one device.

        Raises:
            RuntimeError: called outside ``fit``.
        """
        session = self._session
        if session is None or not isinstance(session.plan, FitPlan):
            raise RuntimeError("update_bn: called outside fit (it reads the fit's training "
                               "data). Fix: call it from a callback's on_train_end, or use "
                               "torch.optim.swa_utils.update_bn(loader, model.module).")
        session.update_bn()

    # -- one call's lifecycle -------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, plan: CallPlan, compiled: Compiled | None) -> Iterator[Session]:
        """Run a call on replicas for its placement. On any error or interrupt the model is
        left as after its last completed optimizer step; the host module always ends with
        the averaged weights and every submodule in the train/eval mode it had
        (``fitdp.call.modes``)."""
        if self._session is not None:
            raise RuntimeError("fit/evaluate/predict: called from inside another call (a "
                               "callback); run it after the current call returns")
        tree = HostTree.read(self.module)  # (one walk: the modes and the weights)
        modes = Modes(self.module, tree.modules)
        positions = [(s, s.state_dict()) for s in plan.borrowed]
        plan.join()  # under torchrun: the process group, and every rank's data compared
        replicas = self._attach(plan.placement, compiled, tree)
        for source in (plan.source, getattr(plan, "val", None)):
            if source is not None:
                replicas.prepare(source.plan())
        session = Session(compiled, replicas, self.run, plan, modes)
        self._session = session
        try:
            with GUARD.installed():
                yield session
        except BaseException as err:
            session.rollback(err)
            try:  # checkpoints saved before the failure are on disk when it surfaces
                self.wait_for_saves()
            except Exception as save_err:  # noqa: BLE001 - the call's own error wins
                warnings.warn(f"a background checkpoint save failed too: {save_err!r}",
                              FitdpWarning, stacklevel=3)
            if not isinstance(err, Preempted):  # (every rank stops at the same step)
                plan.ranks.report_failure(err)
            raise
        finally:
            self._session = None
            if session.example_inputs is not None:
                self.example_inputs = session.example_inputs
            session.close()
            for source, position in positions:  # read from the start, given back unmoved
                source.load_state_dict(position)
            tree = HostTree.read(self.module)  # (as the call leaves it)
            replicas.store_host(self.module, tree)
            modes.restore(self.module, tree.modules)

    def _attach(self, placement: Placement, compiled: Compiled | None,
                tree: HostTree) -> Replicas:
        """The replicas for ``placement`` (reused when they fit), holding the host weights
        (``tree``: the host module as the call found it), with the optimizer bound to them.
        Built whole before the old ones go."""
        current = self._replicas
        if current is not None and current.fits(tree.params, placement, compiled):
            current.load_host(self.module, tree)
            return current
        if placement.default_bucket_key is None and current is not None:
            placement = Placement(placement.devices, placement.work_load_list,
                                  placement.ranks, current.placement.default_bucket_key)
        self._release()
        step = CustomStep(self, list(placement.devices), placement.distributed) \
            if self.steps_overridden else None
        replicas = Replicas(self.module, self.bucket_module, placement, self._compiled, step)
        if self._compiled is not None and self._compiled.optimizer is not None:
            replicas.bind(self._compiled.optimizer, self.module, to_host=False)
        self._replicas = replicas
        replicas.load_host(self.module)
        return replicas

    def _release(self) -> None:
        """Drop the replicas: their weights averaged into the host module, the optimizer
        carried back to the host's parameters, their threads stopped."""
        replicas, self._replicas = self._replicas, None
        if replicas is None:
            return
        replicas.store_host(self.module)
        if replicas.compiled is not None and replicas.compiled.optimizer is not None:
            replicas.bind(replicas.compiled.optimizer, self.module, to_host=True)
        replicas.close()

    def _require_compiled(self, what: str) -> Compiled:
        if self._compiled is None:
            raise RuntimeError(f"{what}: the model is not compiled. Fix: call model.compile("
                               f"optimizer=..., loss=..., metrics=...) before model.{what}().")
        return self._compiled

    def close(self) -> None:
        """Release the replicas and their worker threads (the weights stay in ``module``);
        wait for background saves. The model stays usable: a later call starts new ones."""
        self.wait_for_saves()  # (a sharded save's too); raises a failed one's error
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        self._release()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> Model:
        """A copy with its own module, compiled setup, run state and history; no replicas or
        threads (a later call makes new ones). Not through pickle: a lambda ``bucket_module``
        or loss is shared, as ``copy.deepcopy`` shares every function.

        The replicas are released first (their weights are already in ``module``), so the
        copied optimizer follows the copied module's parameters, not the replicas'.
        """
        if self._session is not None:
            raise RuntimeError("copy.deepcopy(model): called during fit/evaluate/predict (from "
                               "a callback); copy the model before or after the call")
        self._release()
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone  # callbacks in the history point back to the model
        fresh = {"_replicas": None, "_session": None, "_writer": None}
        for key, value in self.__dict__.items():
            clone.__dict__[key] = fresh[key] if key in fresh else copy.deepcopy(value, memo)
        return clone

    def __getstate__(self) -> dict[str, Any]:
        """A trained Model pickles as its module, compiled setup, run state and history (no
        replicas or threads: a later call makes new ones)."""
        self._release()
        for what, obj in self._pickle_parts():
            try:
                pickle.dumps(obj)
            except Exception as err:  # noqa: BLE001 - which part fails is the message
                raise TypeError(
                    f"Model cannot be pickled: {what} holds {obj!r}, which pickle cannot "
                    f"store ({type(err).__name__}: {err}). Fix: use module-level functions "
                    f"instead of lambdas or local functions there, or save with "
                    f"model.save(path) and torch.save(model.module, ...)."
                ) from err
        state = dict(self.__dict__)
        state.update(_replicas=None, _session=None, _writer=None)
        return state

    def _pickle_parts(self) -> list[tuple[str, Any]]:
        parts: list[tuple[str, Any]] = [("bucket_module", self.bucket_module)]
        if self._compiled is not None:
            cfg = self._compiled.config
            parts += [("compile(optimizer=...)", cfg.optimizer), ("compile(loss=...)", cfg.loss),
                      ("compile(lr_scheduler=...)", cfg.lr_scheduler),
                      ("the LR scheduler", self._compiled.scheduler)]
        return parts
