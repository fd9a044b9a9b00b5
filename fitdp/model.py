"""``fitdp.Model``: compile / fit / evaluate / predict over the data-parallel executor manager."""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.batch import tree_cat, tree_map
from fitdp import resume as resume_lib
from fitdp.callbacks import Callback, CallbackList, History
from fitdp.checkpoint import restore_rng_state, save_checkpoint, load_checkpoint
from fitdp.data import as_tensors, make_source, split_validation
from fitdp.devices import DevicesArg
from fitdp.engine import PRECISIONS, CompileConfig, Engine
from fitdp.export import export_module
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
    ) -> None:
        """Choose the optimizer, loss and metrics (see API.md). Resets optimizer state."""
        check_optimizer(optimizer)
        resolve_loss(loss)
        if precision not in PRECISIONS:
            raise ValueError(f"precision: got {precision!r}; expected one of {list(PRECISIONS)}")
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm: got {grad_clip_norm}; expected a positive number")
        _check_int("grad_accum_steps", grad_accum_steps, 1)
        if lr is not None and not lr > 0:
            raise ValueError(f"lr: got {lr}; expected a positive learning rate")
        config = CompileConfig(
            optimizer, loss, named_metrics(metrics), lr, lr_scheduler, precision,
            grad_clip_norm, grad_accum_steps, compile,
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
        resume: str | None = None,
        log_every: int = 50,
    ) -> History:
        """Train for ``epochs`` epochs; returns the ``History`` (see API.md)."""
        engine = self._compiled("fit")
        _check_int("batch_size", batch_size, 1)
        _check_int("epochs", epochs, 0)
        _check_int("initial_epoch", initial_epoch, 0)
        _check_int("log_every", log_every, 1)
        if steps_per_epoch is not None:
            _check_int("steps_per_epoch", steps_per_epoch, 1)
        if monitor is not None and not isinstance(monitor, Monitor):
            raise TypeError(f"monitor: got {type(monitor).__name__}; expected a fitdp.Monitor")
        seed = _resolve_seed(seed)
        if validation_split:
            if validation_data is not None:
                raise ValueError("validation_split: pass validation_data or validation_split, not both")
            if y is None and isinstance(data, tuple) and len(data) == 2:
                data, y = data
            data, y, vx, vy = split_validation(
                as_tensors(data, "data"), as_tensors(y, "y"), validation_split
            )
            validation_data = (vx, vy)
        train = make_source(data, y, batch_size=batch_size, shuffle=shuffle, seed=seed)
        val = None
        if validation_data is not None:
            val = make_source(validation_data, None, batch_size=batch_size, shuffle=False, seed=seed)
        cbs = self._callbacks(callbacks, verbose, epochs=epochs, steps=steps_per_epoch or _len(train),
                              batch_size=batch_size)
        mgr = engine.attach(devices, work_load_list, batch_size if hasattr(train, "x") else None,
                            default_bucket_key=getattr(train, "default_bucket_key", None))
        if hasattr(train, "provide_data"):
            mgr.reserve([*train.provide_data, *train.provide_label])
        if monitor is not None:
            mgr.install_monitor(monitor)
        self._progress = Progress(train, cbs, initial_epoch)
        rng = None
        path = resume_lib.resume_path(resume, cbs.callbacks)
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
                logs = self._run("train", train, cbs, steps_per_epoch, log_every, monitor)
                if val is not None:
                    val_logs = self._evaluate(val, cbs, log_every)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                if engine.scheduler is not None and engine.scheduler_interval == "epoch":
                    with warnings.catch_warnings():
                        # After resuming at an epoch's end no optimizer step precedes this
                        # one in this process; the order is right, torch's warning is not.
                        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                        engine.scheduler.step()
                self._progress.epoch_done = True
                cbs.call("on_epoch_end", epoch, logs)
                if self.stop_training:
                    break
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
        """Loss and every metric over ``data``: ``{"loss": ..., "<metric>": ...}``."""
        engine = self._compiled("evaluate")
        _check_int("batch_size", batch_size, 1)
        source = make_source(data, y, batch_size=batch_size, shuffle=False, seed=0)
        engine.attach(devices, None, batch_size if hasattr(source, "x") else None)
        cbs = self._callbacks(callbacks, verbose, steps=_len(source), batch_size=batch_size)
        return self._evaluate(source, cbs, log_every=50)

    def predict(
        self, data: Any, *, batch_size: int = 32, devices: DevicesArg = "auto",
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """Outputs for every sample, one row per input sample, in input order, on the CPU."""
        if self._engine is None:  # Keras predicts without compile; so do we
            self._engine = Engine(self.module, CompileConfig(None, None, {}), self.bucket_module)
        _check_int("batch_size", batch_size, 1)
        source = make_source(data, None, batch_size=batch_size, shuffle=False, seed=0,
                             has_labels=False)
        self._engine.attach(devices, None, batch_size if hasattr(source, "x") else None)
        cbs = self._callbacks(callbacks, 0, steps=_len(source), batch_size=batch_size)
        cbs.call("on_predict_begin", {})
        outputs, index = self._run("predict", source, cbs, None, 1)
        cbs.call("on_predict_end", {})
        if not outputs:
            raise ValueError("data: no batches to predict on; expected at least one sample")
        result = tree_cat(outputs)
        if index is not None:  # e.g. a BucketIterator: put the rows back in input order
            order = torch.argsort(index)
            result = tree_map(lambda t: t[order], result)
        return result

    # -- the loop, written once for train / test / predict ------------------------------

    def _run(
        self, mode: str, source: Any, cbs: CallbackList, steps: int | None, log_every: int,
        monitor: Monitor | None = None,
    ) -> Any:
        engine = self._compiled(mode)
        begin, end = f"on_{mode}_batch_begin", f"on_{mode}_batch_end"
        sync_each = cbs.sync_every_batch
        logs: dict[str, float] = {}
        outputs: list[Any] = []
        indices: list[torch.Tensor | None] = []
        batches = source if steps is None else itertools.islice(source, steps)
        for step, batch in enumerate(batches):
            if step == 0:
                engine.check_batch(batch)
            cbs.call(begin, step, {})
            if monitor is not None:
                monitor.tic()
            if mode == "train":
                self.global_step += engine.train_step(batch)
            else:
                engine.eval_step(batch, with_metrics=mode == "test")
            if monitor is not None:
                monitor.toc_print()
            if mode == "predict":
                outputs.append(tree_cat([tree_map(_to_host, o) for o in engine.manager.outputs()]))
                indices.append(batch.index)
            elif sync_each or (step + 1) % log_every == 0:
                logs = engine.read_logs()  # a host sync: only at log points
            cbs.call(end, step, logs)
            if self.stop_training:
                break
        if mode == "predict":
            full = None if any(i is None for i in indices) or not indices else torch.cat(indices)  # type: ignore[misc]
            return outputs, full
        if mode == "train":
            self.global_step += engine.flush()
        return engine.read_logs()

    def _evaluate(self, source: Any, cbs: CallbackList, log_every: int) -> dict[str, float]:
        engine = self._compiled("evaluate")
        engine.reset_logs()
        cbs.call("on_test_begin", {})
        logs = self._run("test", source, cbs, None, log_every)
        cbs.call("on_test_end", logs)
        return logs

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
        if callbacks is not None:
            if isinstance(callbacks, Callback) or not isinstance(callbacks, Sequence):
                raise TypeError(
                    f"callbacks: got {type(callbacks).__name__}; expected a list of "
                    f"fitdp.callbacks.Callback"
                )
            for cb in callbacks:
                if not isinstance(cb, Callback):
                    raise TypeError(
                        f"callbacks: got an entry of type {type(cb).__name__}; expected "
                        f"fitdp.callbacks.Callback instances"
                    )
        level = 1 if verbose == "auto" else verbose
        if level not in (0, 1, 2):
            raise ValueError(f"verbose: got {verbose!r}; expected 'auto', 0, 1 or 2")
        return CallbackList(
            list(callbacks or []), model=self, add_history=True,
            add_progbar=bool(level) and self.is_main_process, verbose=int(level),
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

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` (by name) into the host module and every replica."""
        self.module.load_state_dict(weights)
        if self._engine is not None and self._engine.mgr is not None:
            self._engine.mgr.set_params(*self._engine.host_state())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _len(source: Any) -> int | None:
    try:
        return len(source)
    except TypeError:
        return None


def _resolve_seed(seed: int | None) -> int:
    if seed is None:
        # Drawn from torch's global RNG, so torch.manual_seed makes the data order reproducible.
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: got {type(seed).__name__}; expected an int or None")
    return seed


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected an int")
    if value < minimum:
        raise ValueError(f"{name}: got {value}; expected an int >= {minimum}")
