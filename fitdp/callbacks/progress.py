"""Progress reporting: `ProgressBar` (tqdm, or one line per epoch) and MXNet's `Speedometer`."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import Any

from fitdp.callbacks._log_format import log_items, take_fitting, wrap
from fitdp.callbacks.base import Callback
from fitdp.checks import check_choice, check_int

logger = logging.getLogger("fitdp")

_POSTFIX_EVERY = 0.2  # seconds between postfix updates: formatting costs more than a small step
_MIN_BAR = 4  # columns the live bar keeps when the logs beside it need the room
UNITS = {"samples_per_sec": "samples/s", "tokens_per_sec": "tokens/s"}  # model.throughput's


def _rate(count: float, seconds: float) -> str:
    rate = count / seconds if seconds > 0 else float("inf")
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2f}"


def _columns() -> int:
    """The terminal's width (`COLUMNS` when set; 80 when there is no terminal)."""
    return shutil.get_terminal_size((80, 24)).columns


class ProgressBar(Callback):
    """Shows training progress: a tqdm bar per epoch on a terminal, else one line per epoch.

    On a terminal (`sys.stdout.isatty()`) with `verbose=1` each epoch gets a bar with steps/s,
    ETA and the loss and metrics; what does not fit on the bar's line at the end of the epoch
    (validation metrics, say) follows on indented lines. Otherwise (a log file, a CI job, or
    `verbose=2`) it prints one line per epoch, Keras style:
    `Epoch 3/10 - 12s - 45 steps/s - 1440 samples/s - loss: 0.1234 - acc: 0.9612 - val_loss:
    0.2345` (the model's `throughput`: samples/s, and tokens/s for sequence data).
    Nothing is wider than the terminal (`COLUMNS`, 80 without one): long metric names are
    shortened (`multiclass_accuracy` -> `acc`, see `docs/callbacks.md`), every number has 4
    significant digits, and a line too long for the width wraps between items. A resumed fit
    starts with `resumed from <file> at epoch e, step s`. It is silent with `verbose=0` and on
    every process but the main one. Standalone `evaluate`/`predict` get the same treatment;
    validation inside `fit` is reported on the epoch line only.

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
        Epoch 1/2 - 0s - ... steps/s - loss: 0.5
    """

    needs_batch_logs = False  # the bar shows batch logs throttled; a few batches old is fine

    def __init__(self, verbose: int | str | None = None) -> None:
        super().__init__()
        check_choice("ProgressBar(verbose=...)", verbose, (None, "auto", 0, 1, 2),
                     "0 is silent, 1 a bar (lines when not a terminal), 2 one line per epoch, "
                     "None takes fit's verbose")
        self.verbose = verbose
        self._bar: Any = None
        self._mode = "silent"
        self._in_fit = False
        self._t0 = self._last_postfix = 0.0
        self._steps = 0
        self._width = 80
        self._title = ""

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
        self._width = _columns()
        if self._mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stdout,
                             ncols=self._width, leave=True)

    def _postfix(self, items: list[str]) -> int:
        """Show the leading `items` that fit beside the bar; return how many."""
        from tqdm import tqdm

        # The meter without postfix; the live bar is drawn 10 wide here and may shrink.
        meter = dict(self._bar.format_dict, ncols=None, postfix=None)
        fixed = len(tqdm.format_meter(**meter))
        if self._bar.bar_format is None:
            fixed -= 10 - _MIN_BAR
        n = take_fitting(items, self._width - fixed - len(", "))
        self._bar.set_postfix_str(" - ".join(items[:n]), refresh=False)
        return n

    def _step(self, batch: int, logs: dict[str, float] | None) -> None:
        self._steps = batch + 1
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.perf_counter()
        if logs and now - self._last_postfix >= _POSTFIX_EVERY:
            self._last_postfix = now
            self._postfix(log_items(logs))

    def _finish(self, title: str, logs: dict[str, float] | None,
                rates: dict[str, float] | None = None) -> None:
        elapsed = time.perf_counter() - self._t0
        speed = [f"{_rate(v, 1.0)} {UNITS[k]}" for k, v in (rates or {}).items() if k in UNITS]
        items = speed + log_items(logs)
        if self._bar is not None:
            # The finished epoch keeps a compact line (no bar, no ETA): room for the logs.
            total = "/{total_fmt}" if self._bar.total is not None else " steps"
            self._bar.bar_format = "{desc}: {n_fmt}" + total + " [{elapsed}, {rate_fmt}{postfix}]"
            shown = self._postfix(items)
            self._bar.close()
            self._bar = None
            if shown < len(items):
                print("\n".join(wrap(items[shown:], self._width, "  ", "  ")), flush=True)
        elif self._mode == "line":
            head = [title, f"{elapsed:.0f}s", f"{_rate(self._steps, elapsed)} steps/s"]
            print("\n".join(wrap(head + items, self._width)), flush=True)

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._in_fit = True
        self._mode = self._resolve_mode()
        resumed = self.params.get("resumed")
        if resumed and self._mode != "silent":
            print(f"resumed from {resumed['path']} at epoch {int(resumed['epoch']) + 1}, "
                  f"step {int(resumed['step'])}", flush=True)

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        epochs = self.params.get("epochs")
        self._title = f"Epoch {epoch + 1}/{epochs}" if epochs else f"Epoch {epoch + 1}"
        self._start(self._title, self.params.get("steps"))

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._step(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._finish(self._title, logs, getattr(self.model, "throughput", None))

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
        TypeError: `batch_size` or `frequent` is not an int.
        ValueError: `batch_size` or `frequent` is below 1.

    Example:
        >>> speed = Speedometer(batch_size=32, frequent=50)  # INFO logs of the "fitdp" logger
        >>> speed.needs_batch_logs
        False
    """

    needs_batch_logs = False  # logs the values every `frequent` batches; a few batches old is fine

    def __init__(self, batch_size: int, frequent: int = 50) -> None:
        super().__init__()
        self.batch_size = check_int("Speedometer(batch_size=...)", batch_size, 1)
        self.frequent = check_int("Speedometer(frequent=...)", frequent, 1)
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
