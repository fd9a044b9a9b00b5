"""Progress reporting: `ProgressBar` (tqdm, or one line per epoch) and MXNet's `Speedometer`."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from fitdp.callbacks._monitor import check_count
from fitdp.callbacks.base import Callback

logger = logging.getLogger("fitdp")


def format_value(value: float) -> str:
    """Keras's number format: 4 decimals, or scientific notation for tiny values."""
    return f"{value:.4f}" if value == 0 or abs(value) > 1e-3 else f"{value:.4e}"


def format_logs(logs: dict[str, float] | None) -> str:
    """`loss: 0.1234 - multiclass_accuracy: 0.9612`, keys in the order the logs give them."""
    return " - ".join(f"{k}: {format_value(float(v))}" for k, v in (logs or {}).items())


def _rate(steps: int, seconds: float) -> str:
    rate = steps / seconds if seconds > 0 else float("inf")
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2f}"


class ProgressBar(Callback):
    """Shows training progress: a tqdm bar per epoch on a terminal, else one line per epoch.

    On a terminal (`sys.stdout.isatty()`) with `verbose=1` each epoch gets a bar with steps/s,
    ETA and the loss and metrics; validation metrics join at epoch end. Otherwise (a log file,
    a CI job, or `verbose=2`) it prints exactly one line per epoch, Keras style:
    `Epoch 3/10 - 12s - 45 steps/s - loss: 0.1234 - val_loss: 0.2345`. It is silent with
    `verbose=0` and on every process but the main one. Standalone `evaluate`/`predict` get the
    same treatment; validation inside `fit` is reported on the epoch line only.

    Args:
        verbose: 0 (silent), 1 (bar on a terminal, lines otherwise), 2 (lines always), "auto"
            (same as 1) or None (take `params["verbose"]`, default 1).

    Raises:
        ValueError: `verbose` is not one of the above.

    Example:
        >>> bar = ProgressBar(verbose=2)
        >>> bar.set_params({"epochs": 2, "steps": 10})
        >>> bar.on_train_begin(); bar.on_epoch_begin(0)
        >>> bar.on_epoch_end(0, {"loss": 0.5})  # doctest: +ELLIPSIS
        Epoch 1/2 - 0s - ... steps/s - loss: 0.5000
    """

    def __init__(self, verbose: int | str | None = None) -> None:
        super().__init__()
        if verbose not in (None, "auto", 0, 1, 2) or isinstance(verbose, bool):
            raise ValueError(f"ProgressBar(verbose=...) got {verbose!r}; expected 0 (silent), "
                             "1 (bar, or one line per epoch when not a terminal), 2 (one line "
                             "per epoch), 'auto' or None (use fit's verbose).")
        self.verbose = verbose
        self._bar: Any = None
        self._mode = "silent"
        self._in_fit = False
        self._t0 = self._last_postfix = 0.0
        self._steps = 0

    def _resolve_mode(self) -> str:
        """'bar', 'line' or 'silent', decided at the start of each run."""
        verbose = self.verbose if self.verbose is not None else self.params.get("verbose", 1)
        verbose = 1 if verbose in ("auto", None) else verbose
        if verbose == 0 or not self._is_main_process():
            return "silent"
        isatty = getattr(sys.stdout, "isatty", None)
        return "bar" if verbose == 1 and isatty is not None and isatty() else "line"

    def _start(self, desc: str, total: int | None) -> None:
        self._t0 = self._last_postfix = time.perf_counter()
        self._steps = 0
        if self._mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stdout,
                             dynamic_ncols=True, leave=True)

    def _step(self, batch: int, logs: dict[str, float] | None) -> None:
        self._steps = batch + 1
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.perf_counter()
        # Formatting the postfix costs more than the step of a small model: throttle it.
        if logs and now - self._last_postfix >= 0.2:
            self._last_postfix = now
            self._bar.set_postfix_str(format_logs(logs), refresh=False)

    def _finish(self, title: str, logs: dict[str, float] | None) -> None:
        elapsed = time.perf_counter() - self._t0
        if self._bar is not None:
            if logs:
                self._bar.set_postfix_str(format_logs(logs), refresh=False)
            self._bar.close()
            self._bar = None
        elif self._mode == "line":
            parts = [title, f"{elapsed:.0f}s", f"{_rate(self._steps, elapsed)} steps/s"]
            text = format_logs(logs)
            print(" - ".join(parts + ([text] if text else [])), flush=True)

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._in_fit = True
        self._mode = self._resolve_mode()

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        epochs = self.params.get("epochs")
        self._title = f"Epoch {epoch + 1}/{epochs}" if epochs else f"Epoch {epoch + 1}"
        self._start(self._title, self.params.get("steps"))

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._step(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._finish(self._title, logs)

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self._bar is not None:  # stopped mid-epoch
            self._bar.close()
            self._bar = None
        self._in_fit = False

    def on_test_begin(self, logs: dict[str, float] | None = None) -> None:
        if not self._in_fit:
            self._mode = self._resolve_mode()
            self._start("Evaluate", self.params.get("steps"))

    def on_test_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if not self._in_fit:
            self._step(batch, logs)

    def on_test_end(self, logs: dict[str, float] | None = None) -> None:
        if not self._in_fit:
            self._finish("Evaluate", logs)

    def on_predict_begin(self, logs: dict[str, float] | None = None) -> None:
        self._mode = self._resolve_mode()
        self._start("Predict", self.params.get("steps"))

    def on_predict_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._step(batch, None)

    def on_predict_end(self, logs: dict[str, float] | None = None) -> None:
        self._finish("Predict", None)


class Speedometer(Callback):
    """MXNet's Speedometer: logs throughput and the running logs every `frequent` batches.

    Each report goes to the `fitdp` logger at INFO level, in MXNet's format:
    `Epoch[0] Batch [50-100]\\tSpeed: 1234.56 samples/sec\\tloss=0.123400`. The logged values
    are the batch logs as last synced by the model (they may be a few batches old).

    Args:
        batch_size: samples per batch of this process, for samples/sec.
        frequent: report every this many batches.

    Raises:
        ValueError: `batch_size` or `frequent` is not a positive int.

    Example:
        >>> import logging; logging.basicConfig(level=logging.INFO)
        >>> speed = Speedometer(batch_size=32, frequent=50)
    """

    def __init__(self, batch_size: int, frequent: int = 50) -> None:
        super().__init__()
        self.batch_size = check_count("batch_size", batch_size, "Speedometer")
        self.frequent = check_count("frequent", frequent, "Speedometer")
        self._tic = 0.0
        self._last = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._epoch = epoch
        self._tic = time.perf_counter()
        self._last = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        count = batch + 1
        if count % self.frequent or not self._is_main_process():
            return
        now = time.perf_counter()
        elapsed = now - self._tic
        speed = (count - self._last) * self.batch_size / elapsed if elapsed > 0 else float("inf")
        items = list((logs or {}).items())
        msg = "Epoch[%d] Batch [%d-%d]\tSpeed: %.2f samples/sec" + "\t%s=%f" * len(items)
        args = [a for k, v in items for a in (k, float(v))]
        logger.info(msg, self._epoch, self._last, count, speed, *args)
        self._tic, self._last = now, count
