"""`EarlyStopping`: stop `fit` when a monitored value has stopped improving."""

from __future__ import annotations

from typing import Any

from fitdp.callbacks._monitored_value import is_improvement, monitor_value, resolve_mode
from fitdp.callbacks.base import Callback
from fitdp.checks import check_bool, check_int, check_number


class EarlyStopping(Callback):
    """Stops training when `monitor` has not improved for `patience` epochs (Keras 3 semantics).

    An epoch improves when its value beats the best so far by more than `min_delta`. The wait
    counter restarts only when the value also beats `baseline` (when given): a run still short
    of the baseline keeps counting while it improves, and stops at its first epoch without
    improvement once `patience` epochs have passed. Epochs before `start_from_epoch` are
    ignored. With `restore_best_weights`, the weights of the best epoch (`model.get_weights()`)
    are put back with `model.set_weights` at the end of training, as Keras 3 does: whether the
    run stopped early or ran all its epochs (Keras 2 restored only when it stopped early).

    Args:
        monitor: the log key to watch, e.g. "val_loss".
        min_delta: smallest change that counts as an improvement (>= 0).
        patience: epochs without improvement before stopping.
        mode: "min", "max" or "auto" (from the key's name, see `ModelCheckpoint`).
        baseline: a value the monitored key must beat for the wait to restart.
        restore_best_weights: put back the best epoch's weights at the end of training.
        start_from_epoch: epochs to wait before watching (warm-up).
        verbose: 1 prints when it stops and when it restores.

    Raises:
        TypeError: `patience` or `start_from_epoch` is not an int, `min_delta` or `baseline`
            not a number.
        ValueError: a negative `min_delta`/`patience`/`start_from_epoch` or a bad `mode`.

    Example:
        >>> stop = EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True)
        >>> stop.mode
        'min'
    """

    state_field = "monitor"

    needs_batch_logs = False  # epoch logs only

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0, patience: int = 0,
                 mode: str = "auto", baseline: float | None = None,
                 restore_best_weights: bool = False, start_from_epoch: int = 0,
                 verbose: int = 0) -> None:
        super().__init__()
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode, "EarlyStopping")
        self.min_delta = check_number("EarlyStopping(min_delta=...)", min_delta, low=0)
        self.patience = check_int("EarlyStopping(patience=...)", patience, 0)
        self.baseline = None if baseline is None else check_number(
            "EarlyStopping(baseline=...)", baseline)
        self.restore_best_weights = check_bool("EarlyStopping(restore_best_weights=...)",
                                               restore_best_weights)
        self.start_from_epoch = check_int("EarlyStopping(start_from_epoch=...)",
                                          start_from_epoch, 0)
        self.verbose = verbose
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_epoch = 0
        self.best_weights: dict[str, Any] | None = None

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        # A new fit starts over (Keras); a resumed one loads its state after this.
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        current = monitor_value(logs, self.monitor, "EarlyStopping")
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            # Until something improves, the weights of the first watched epoch are the best.
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch
        self.wait += 1
        if is_improvement(current, self.best, self.mode, self.min_delta):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or is_improvement(current, self.baseline, self.mode,
                                                       self.min_delta):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        talk = self.verbose > 0 and self._is_main_process()
        if self.stopped_epoch > 0 and talk:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if talk:
                print(f"Restoring model weights from the end of the best epoch: "
                      f"{self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)

    def state_dict(self) -> dict[str, Any]:
        """Counters, best value and (with `restore_best_weights`) the best weights."""
        return {"wait": self.wait, "stopped_epoch": self.stopped_epoch, "best": self.best,
                "best_epoch": self.best_epoch, "best_weights": self.best_weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run (called after `on_train_begin`)."""
        self.wait = int(state["wait"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best = None if state["best"] is None else float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.best_weights = state.get("best_weights")
