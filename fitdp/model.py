"""``fitdp.Model``: compile / fit / evaluate / predict over the data-parallel executor manager."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fitdp import distributed
from fitdp import resume as resume_lib
from fitdp.args import check_callbacks, check_int, resolve_seed, verbose_level
from fitdp.callbacks import Callback, CallbackList, History
from fitdp.checkpoint import load_checkpoint, restore_rng_state, save_checkpoint
from fitdp.data import TensorSource, as_tensors, make_source, split_validation
from fitdp.devices import DevicesArg, resolve_devices
from fitdp.distributed import DEFAULT_TIMEOUT, DistInfo, report_failure
from fitdp.engine import PRECISIONS, CompileConfig, Engine
from fitdp.executor.manager import DataParallelExecutorManager
from fitdp.export import export_module
from fitdp.loop import assemble, run_batches
from fitdp.metrics import MetricsArg, named_metrics
from fitdp.monitor import Monitor
from fitdp.objectives import resolve_loss
from fitdp.optimizers import OptimizerArg, check_optimizer


@dataclasses.dataclass
class Progress:
    """Where a fit is, for checkpoints: its data source, callbacks and epoch."""

    source: Any = None
    callbacks: CallbackList | None = None
    epoch: int = 0
    epoch_done: bool = False

    @property
    def resume_epoch(self) -> int:
        return self.epoch + 1 if self.epoch_done else self.epoch


class Model:
    """A Keras-style facade over a ``torch.nn.Module``, trained data-parallel.

    Args:
        module: the network. After ``fit`` it holds the trained, device-averaged weights.
        bucket_module: ``callable(bucket_key) -> nn.Module`` for variable-length data; the
            module it returns shares every parameter and buffer by name with ``module``.

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
            raise TypeError(f"module: got {type(module).__name__}; expected a torch.nn.Module")
        if bucket_module is not None and not callable(bucket_module):
            raise TypeError(
                f"bucket_module: got {type(bucket_module).__name__}; expected a "
                f"callable(bucket_key) -> nn.Module"
            )
        self.module = module
        self.bucket_module = bucket_module
        self.stop_training = False
        self.global_step = 0
        self.is_main_process = True
        self.history: History | None = None
        self._engine: Engine | None = None
        self._progress = Progress()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._engine.optimizer if self._engine is not None else None

    def compile(
        self,
        optimizer: OptimizerArg = "adam",
        loss: Any = "cross_entropy",
        metrics: MetricsArg = None,
        *,
        lr: float | None = None,
        lr_scheduler: Any = None,
        precision: str = "32",
        grad_clip_norm: float | None = None,
        grad_accum_steps: int = 1,
        compile: bool = False,
        sync_batchnorm: bool = False,
    ) -> None:
        """Choose the optimizer, loss and metrics (see API.md). Resets optimizer state.

        ``sync_batchnorm``: under torch.distributed on CUDA, BatchNorm layers become
        ``torch.nn.SyncBatchNorm`` (statistics over every rank's batch).
        """
        check_optimizer(optimizer)
        resolve_loss(loss)
        if precision not in PRECISIONS:
            raise ValueError(f"precision: got {precision!r}; expected one of {list(PRECISIONS)}")
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm: got {grad_clip_norm}; expected a positive number")
        check_int("grad_accum_steps", grad_accum_steps, 1)
        if lr is not None and not lr > 0:
            raise ValueError(f"lr: got {lr}; expected a positive learning rate")
        config = CompileConfig(
            optimizer, loss, named_metrics(metrics), lr, lr_scheduler, precision,
            grad_clip_norm, grad_accum_steps, compile, sync_batchnorm,
        )
        if self._engine is not None and self._engine.mgr is not None:
            self._engine.detach()
            self._engine.mgr.close()
        self._engine = Engine(self.module, config, self.bucket_module)

    def fit(
        self,
        data: Any = None,
        y: Any = None,
        *,
        batch_size: int = 32,
        epochs: int = 1,
        devices: DevicesArg = "auto",
        work_load_list: Sequence[float] | None = None,
        validation_data: Any = None,
        validation_split: float = 0.0,
        shuffle: bool = True,
        callbacks: Sequence[Callback] | None = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        verbose: int | str = "auto",
        seed: int | None = None,
        monitor: Monitor | None = None,
        resume: str | os.PathLike[str] | None = None,
        log_every: int = 50,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> History:
        """Train for ``epochs`` epochs; returns the ``History`` (see API.md).

        ``log_every``: batches between host reads of loss and metrics. ``timeout``: seconds
        a collective may wait under torch.distributed before every rank fails.
        """
        engine = self._compiled("fit")
        for name, value, low in (("batch_size", batch_size, 1), ("epochs", epochs, 0),
                                 ("initial_epoch", initial_epoch, 0), ("log_every", log_every, 1)):
            check_int(name, value, low)
        if steps_per_epoch is not None:
            check_int("steps_per_epoch", steps_per_epoch, 1)
        if monitor is not None and not isinstance(monitor, Monitor):
            raise TypeError(f"monitor: got {type(monitor).__name__}; expected a fitdp.Monitor")
        seed = resolve_seed(seed)
        if validation_split:
            if validation_data is not None:
                raise ValueError(
                    "validation_split: pass validation_data or validation_split, not both"
                )
            if y is None and isinstance(data, tuple) and len(data) == 2:
                data, y = data
            data, y, vx, vy = split_validation(
                as_tensors(data, "data"), as_tensors(y, "y"), validation_split
            )
            validation_data = (vx, vy)
        info = self._join(devices, timeout)
        train = make_source(data, y, batch_size=batch_size, shuffle=shuffle, seed=seed,
                            rank=info.rank, world_size=info.world_size)
        if hasattr(train, "check_epochs"):
            train.check_epochs(epochs - initial_epoch)
        val = None if validation_data is None else make_source(
            validation_data, None, batch_size=batch_size, shuffle=False, seed=seed,
            rank=info.rank, world_size=info.world_size)
        cbs = self._callbacks(callbacks, verbose, epochs=epochs, batch_size=batch_size,
                              steps=steps_per_epoch or _len(train))
        mgr = self._attach(engine, train, devices, work_load_list, batch_size, info)
        if monitor is not None:
            mgr.install_monitor(monitor)
        self._progress = Progress(train, cbs, initial_epoch)
        path = resume_lib.resume_path(resume, cbs.callbacks)
        rng = None
        if path is not None:
            initial_epoch, rng = resume_lib.load_for_resume(path, self, train, cbs)
        self.stop_training = False
        logs: dict[str, float] = {}
        cbs.call("on_train_begin", logs)
        if rng is not None:
            restore_rng_state(rng)  # last: nothing above may draw from the restored state
        try:
            for epoch in range(initial_epoch, epochs):
                self._progress.epoch, self._progress.epoch_done = epoch, False
                train.set_epoch(epoch)
                engine.reset_logs()
                cbs.call("on_epoch_begin", epoch, {})
                logs = run_batches(self, engine, "train", train, cbs, steps_per_epoch,
                                   log_every, monitor)
                engine.sync_buffers()
                if val is not None:
                    val_logs = self._evaluate(val, cbs, log_every)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                engine.step_epoch_scheduler()
                self._progress.epoch_done = True
                cbs.call("on_epoch_end", epoch, logs)
                if self.stop_training:
                    break
        except BaseException as err:
            if info.enabled:
                report_failure(info, err)
            raise
        finally:
            engine.detach()
            if monitor is not None:
                monitor.remove()
                mgr.monitor = None
        cbs.call("on_train_end", logs)
        self.history = cbs.history
        return cbs.history

    def evaluate(
        self,
        data: Any = None,
        y: Any = None,
        *,
        batch_size: int = 32,
        devices: DevicesArg = "auto",
        callbacks: Sequence[Callback] | None = None,
        verbose: int | str = "auto",
    ) -> dict[str, float]:
        """Loss and every metric over ``data``: ``{"loss": ..., "<metric>": ...}``; exact over
        the whole data set under torch.distributed too."""
        engine = self._compiled("evaluate")
        check_int("batch_size", batch_size, 1)
        info = self._join(devices, DEFAULT_TIMEOUT)
        source = make_source(data, y, batch_size=batch_size, shuffle=False, seed=0,
                             rank=info.rank, world_size=info.world_size)
        self._attach(engine, source, devices, None, batch_size, info)
        cbs = self._callbacks(callbacks, verbose, steps=_len(source), batch_size=batch_size)
        with _keep_mode(self.module):
            return self._evaluate(source, cbs, log_every=50)

    def predict(
        self, data: Any, *, batch_size: int = 32, devices: DevicesArg = "auto",
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """Outputs for every sample, one row per input sample, in input order, on the CPU
        (under torch.distributed: all rows, on every rank)."""
        if self._engine is None:  # Keras predicts without compile; so do we
            self._engine = Engine(self.module, CompileConfig(None, None, {}), self.bucket_module)
        check_int("batch_size", batch_size, 1)
        info = self._join(devices, DEFAULT_TIMEOUT)
        source = make_source(data, None, batch_size=batch_size, shuffle=False, seed=0,
                             has_labels=False, rank=info.rank, world_size=info.world_size)
        self._attach(self._engine, source, devices, None, batch_size, info)
        cbs = self._callbacks(callbacks, 0, steps=_len(source), batch_size=batch_size)
        cbs.call("on_predict_begin", {})
        with _keep_mode(self.module):
            rows = run_batches(self, self._engine, "predict", source, cbs)
        cbs.call("on_predict_end", {})
        return assemble(rows, info.rank, info.world_size)

    def _evaluate(self, source: Any, cbs: CallbackList, log_every: int) -> dict[str, float]:
        engine = self._compiled("evaluate")
        engine.reset_logs()
        cbs.call("on_test_begin", {})
        logs = run_batches(self, engine, "test", source, cbs, None, log_every)
        cbs.call("on_test_end", logs)
        return logs

    def _attach(
        self, engine: Engine, source: Any, devices: DevicesArg,
        work_load_list: Sequence[float] | None, batch_size: int, info: DistInfo,
    ) -> DataParallelExecutorManager:
        """The manager for this call, with input buffers sized for the largest bucket and
        every bucket's group built before any weight changes."""
        # Only in-memory tensors split batch_size per step; other sources bring their batches.
        per_step = batch_size if isinstance(source, TensorSource) else None
        mgr = engine.attach(devices, work_load_list, per_step,
                            getattr(source, "default_bucket_key", None), info.enabled)
        if hasattr(source, "provide_data"):
            mgr.reserve([*source.provide_data, *source.provide_label])
        if hasattr(source, "buckets"):
            mgr.prepare_buckets(source.buckets)
        return mgr

    def _join(self, devices: DevicesArg, timeout: float) -> DistInfo:
        """Under torchrun, join the job; decides ``is_main_process``."""
        info = distributed.from_env()
        distributed.join(info, resolve_devices(devices), timeout)
        self.is_main_process = info.is_main
        return info

    def _compiled(self, what: str) -> Engine:
        if self._engine is None or (what == "fit" and self._engine.config.optimizer is None):
            raise RuntimeError(
                f"{what}: the model is not compiled. Fix: call model.compile(optimizer=..., "
                f"loss=..., metrics=...) before model.{what}()."
            )
        return self._engine

    def _callbacks(
        self, callbacks: Sequence[Callback] | None, verbose: int | str, **params: Any
    ) -> CallbackList:
        level = verbose_level(verbose)
        return CallbackList(
            check_callbacks(callbacks), model=self, add_history=True,
            add_progbar=bool(level) and self.is_main_process, verbose=level,
            params={"verbose": level, **params},
        )

    # -- weights, checkpoints, export -------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint to ``path`` atomically (only the main process writes).

        It holds the device-averaged weights, optimizer, scheduler and scaler state, the
        position in the run (epoch, step, position in the epoch), data order and RNG states:
        ``fit(resume=path)`` continues exactly. Loads with ``torch.load(weights_only=True)``.
        """
        state = resume_lib.training_state(self)
        if self.is_main_process:
            save_checkpoint(path, state)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore weights (into every replica) and, when compiled, optimizer state.

        Raises:
            fitdp.CheckpointError: the file is not a sound fitdp checkpoint.
        """
        resume_lib.restore_weights(self, load_checkpoint(path))

    def export(self, path: str | os.PathLike[str], example_inputs: Any) -> None:
        """Write a single-device predictor (``torch.export``, dynamic batch) of the averaged
        weights in eval mode; load it with ``fitdp.load_predictor(path)``."""
        if self._engine is not None:
            self._engine.detach()
        export_module(self.module, path, example_inputs)


    def get_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of every parameter and buffer, averaged over devices."""
        if self._engine is not None:
            self._engine.detach()
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def nonfinite_weights(self) -> list[str]:
        """Names of floating-point weights holding NaN or inf (no copy; one host sync)."""
        if self._engine is not None:
            self._engine.detach()
        return [k for k, t in self.module.state_dict().items()
                if t.is_floating_point() and not bool(torch.isfinite(t).all())]

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` (by name) into the host module and every replica."""
        self.module.load_state_dict(weights)
        if self._engine is not None and self._engine.mgr is not None:
            self._engine.mgr.set_params(*self._engine.host_state())


@contextlib.contextmanager
def _keep_mode(module: nn.Module) -> Iterator[None]:
    """Give ``module`` back in the train/eval mode it had (with one device it is the replica
    that evaluate and predict switch to eval mode)."""
    training = module.training
    try:
        yield
    finally:
        if module.training is not training:
            module.train(training)


def _len(source: Any) -> int | None:
    try:
        return len(source)
    except TypeError:
        return None
