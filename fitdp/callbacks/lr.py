"""Learning-rate callbacks: `LearningRateScheduler` and `ReduceLROnPlateau` (Keras)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fitdp.callbacks._monitored_value import (
    is_finite,
    is_improvement,
    monitor_value,
    resolve_mode,
)
from fitdp.callbacks.base import Callback
from fitdp.checks import check_int, check_number, fail


def _optimizer(model: Any, owner: str) -> Any:
    """The model's optimizer, or a RuntimeError saying to compile first."""
    opt = model.optimizer
    if opt is None:
        raise RuntimeError(f"{owner} changes the optimizer's learning rate, but the model has "
                           "no optimizer yet. Call model.compile(optimizer=...) before fit.")
    return opt


def _refuse_compiled_scheduler(model: Any, owner: str) -> None:
    """A ValueError when `compile(lr_scheduler=...)` also sets the rate: the two would fight
    (each overwrites the other's rate) and the logged `lr` would depend on their order."""
    scheduler = model.lr_scheduler
    if scheduler is not None:
        fail(f"callbacks ({owner})", f"a model compiled with lr_scheduler="
             f"{type(scheduler).__name__}", "one thing that sets the learning rate",
             f"drop {owner}, or compile without lr_scheduler", described=True)


def _takes_lr(schedule: Callable[..., Any]) -> bool:
    """Whether `schedule` accepts `(epoch, lr)`; Keras's older `schedule(epoch)` does not."""
    try:
        inspect.signature(schedule).bind(0, 0.1)
        return True
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): assume the current API
        return True


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of each epoch to `schedule(epoch, lr)` (Keras).

    `schedule` is called with the 0-based epoch and the current learning rate and returns the
    new one. With several parameter groups it is called per group, with that group's rate
    (once when all groups share a rate), so ratios between groups survive. The rate in use
    (first group) is added to the epoch logs as `"lr"`, so `History` and `CSVLogger` record it.

    Args:
        schedule: `schedule(epoch, lr) -> float` (or Keras's older `schedule(epoch)`).
        verbose: 1 prints each change.

    Raises:
        TypeError: `schedule` is not callable.
        ValueError: (at train begin) the model was compiled with an `lr_scheduler`; (at epoch
            begin) `schedule` returned something that is not a finite number >= 0.

    Example:
        >>> decay = LearningRateScheduler(lambda epoch, lr: lr * 0.9 if epoch >= 10 else lr)
    """

    needs_batch_logs = False  # epoch hooks only

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        if not callable(schedule):
            fail("LearningRateScheduler(schedule=...)", schedule,
                 "a function schedule(epoch, lr) -> new lr", error=TypeError)
        self.schedule = schedule
        self.verbose = verbose
        self._with_lr = _takes_lr(schedule)

    def _new_lr(self, epoch: int, lr: float) -> float:
        new = self.schedule(epoch, lr) if self._with_lr else self.schedule(epoch)
        try:
            value = float(new)
        except (TypeError, ValueError):
            value = float("nan")
        if not is_finite(value) or value < 0:
            fail("LearningRateScheduler(schedule=...)", f"{new!r} returned for epoch {epoch} "
                 f"(lr {lr:g})", "a finite number >= 0", described=True)
        return value

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        _refuse_compiled_scheduler(self.model, "LearningRateScheduler")

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        groups = _optimizer(self.model, "LearningRateScheduler").param_groups
        rates = {float(g["lr"]) for g in groups}
        new = {lr: self._new_lr(epoch, lr) for lr in sorted(rates)}
        for group in groups:
            group["lr"] = new[float(group["lr"])]
        if self.verbose > 0 and self._is_main_process():
            print(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to "
                  f"{', '.join(f'{v:g}' for v in new.values())}.")


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by `factor` when `monitor` stops improving (Keras).

    After `patience` epochs without an improvement larger than `min_delta`, every parameter
    group whose rate is above `min_lr` gets `max(lr * factor, min_lr)`; then `cooldown` epochs
    pass before the wait counts again. The epoch logs' `"lr"` (put there by the model) is the
    rate the epoch trained with, before any reduction at its end.

    Args:
        monitor: the log key to watch.
        factor: multiplier, 0 <= factor < 1.
        patience: epochs without improvement before reducing.
        mode: "min", "max" or "auto" (from the key's name).
        min_delta: smallest change that counts as an improvement (>= 0).
        cooldown: epochs to wait after a reduction before counting again.
        min_lr: lower bound of the learning rate.
        verbose: 1 prints each reduction.

    Raises:
        TypeError: a non-number `factor`, `min_delta` or `min_lr`, a non-int `patience` or
            `cooldown`.
        ValueError: `factor` outside [0, 1), a negative `patience`, `cooldown`, `min_delta` or
            `min_lr`, or a bad `mode`; (at train begin) the model was compiled with an
            `lr_scheduler`.

    Example:
        >>> plateau = ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2, min_lr=1e-5)
    """

    state_field = "monitor"

    needs_batch_logs = False  # epoch hooks only

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0,
                 min_lr: float = 0.0, verbose: int = 0) -> None:
        super().__init__()
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode, "ReduceLROnPlateau")
        self.factor = check_number("ReduceLROnPlateau(factor=...)", factor, low=0, high=1,
                                   high_open=True, fix="factor >= 1 would not reduce the rate; "
                                   "pass e.g. 0.1 or 0.5")
        self.patience = check_int("ReduceLROnPlateau(patience=...)", patience, 0)
        self.min_delta = check_number("ReduceLROnPlateau(min_delta=...)", min_delta, low=0)
        self.cooldown = check_int("ReduceLROnPlateau(cooldown=...)", cooldown, 0)
        self.min_lr = check_number("ReduceLROnPlateau(min_lr=...)", min_lr, low=0)
        self.verbose = verbose
        self._reset()

    def _reset(self) -> None:
        self.best: float | None = None
        self.wait = 0
        self.cooldown_counter = 0

    def in_cooldown(self) -> bool:
        """Whether a recent reduction still suspends the wait."""
        return self.cooldown_counter > 0

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        # Keras resets per fit; a resumed fit loads its state after this.
        _refuse_compiled_scheduler(self.model, "ReduceLROnPlateau")
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        current = monitor_value(logs, self.monitor, "ReduceLROnPlateau")
        if current is None:
            return
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if is_improvement(current, self.best, self.mode, self.min_delta):
            self.best = current
            self.wait = 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience:
                self._reduce(epoch, _optimizer(self.model, "ReduceLROnPlateau").param_groups)

    def _reduce(self, epoch: int, groups: list[dict[str, Any]]) -> None:
        reduced = False
        for group in groups:
            old = float(group["lr"])
            if old > self.min_lr:
                group["lr"] = max(old * self.factor, self.min_lr)
                reduced = True
        if reduced:
            if self.verbose > 0 and self._is_main_process():
                print(f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to "
                      f"{float(groups[0]['lr']):g}.")
            self.cooldown_counter = self.cooldown
            self.wait = 0

    def state_dict(self) -> dict[str, Any]:
        """Best value, wait and cooldown counters (the rates live in the optimizer's state)."""
        return {"best": self.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run (called after `on_train_begin`)."""
        self.best = None if state["best"] is None else float(state["best"])
        self.wait = int(state["wait"])
        self.cooldown_counter = int(state["cooldown_counter"])
