"""`ModelCheckpoint`: save the model every epoch or N steps, optionally only when it improves."""

from __future__ import annotations

import glob
import os
import string
import warnings
from typing import Any

from fitdp.callbacks._monitor import (
    check_count,
    check_save_freq,
    is_finite,
    is_improvement,
    monitor_value,
    resolve_mode,
    step_save_due,
)
from fitdp.callbacks.base import Callback


class ModelCheckpoint(Callback):
    """Saves full checkpoints with `model.save`, Keras style.

    `filepath` is formatted at each save with `epoch` (1-based, as in Keras), `step` (the
    optimizer steps done, `model.global_step`), `batch` (1-based, step-based saves only) and
    every key of the logs: `"ckpt-{epoch:02d}-{val_loss:.3f}.ckpt"`. A save is skipped with a
    warning when the monitored value or the loss is NaN/inf, or when any weight is non-finite,
    so a diverged run never overwrites a good checkpoint. Only the main process writes.

    Args:
        filepath: path template, `str.format` style with named fields only.
        monitor: the log key compared for `save_best_only` and tracked in `best`.
        mode: "min", "max" or "auto" (max for keys naming accuracy, AUC, precision, recall,
            F1 and similar scores; min otherwise and for anything naming a loss or error).
        save_best_only: save only when `monitor` improves on the best value so far.
        save_freq: "epoch" (at each epoch end) or an int N (every N optimizer steps).
        keep: keep only the newest `keep` files this callback wrote; an old file is removed
            only after the new one is complete. None keeps all.
        verbose: 1 prints a line for each save.

    Raises:
        TypeError: `filepath` is not a string or path.
        ValueError: a bad `mode`, `save_freq`, `keep`, or a `filepath` with positional fields.

    Example:
        >>> ckpt = ModelCheckpoint("runs/ckpt-{epoch:02d}-{val_loss:.3f}.ckpt",
        ...                        save_best_only=True, keep=3)
        >>> ckpt.mode
        'min'
    """

    def __init__(self, filepath: str | os.PathLike[str], monitor: str = "val_loss",
                 mode: str = "auto", save_best_only: bool = False,
                 save_freq: str | int = "epoch", keep: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            raise TypeError(f"ModelCheckpoint(filepath=...) got {filepath!r}; expected a "
                            "non-empty path such as 'runs/ckpt-{epoch:02d}.ckpt'.")
        self.filepath = os.fspath(filepath)
        self._fields = _named_fields(self.filepath)
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode, "ModelCheckpoint")
        self.save_best_only = bool(save_best_only)
        self.save_freq = check_save_freq(save_freq, "ModelCheckpoint")
        self.keep = None if keep is None else check_count("keep", keep, "ModelCheckpoint")
        self.verbose = verbose
        self.best: float | None = None
        self._written: list[str] = []
        self._last_step = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        step = int(self.model.global_step)
        if step_save_due(self.save_freq, step, self._last_step):
            self._last_step = step
            self._save(logs, batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._epoch = epoch
        if self.save_freq == "epoch":
            self._save(logs, None)

    def _save(self, logs: dict[str, float] | None, batch: int | None) -> None:
        """Save unless something is non-finite or (`save_best_only`) nothing improved."""
        if not self._is_main_process():
            return
        logs = dict(logs or {})
        where = f"epoch {self._epoch + 1}" + ("" if batch is None else f", batch {batch + 1}")
        for key in dict.fromkeys((self.monitor, "loss")):
            if key in logs and not is_finite(logs[key]):
                warnings.warn(f"ModelCheckpoint skipped the save at {where}: {key} is "
                              f"{logs[key]}; a diverged model must not replace a good "
                              "checkpoint.", RuntimeWarning, stacklevel=3)
                return
        if self.save_best_only:
            current = monitor_value(logs, self.monitor, "ModelCheckpoint(save_best_only=True)")
        else:
            current = float(logs[self.monitor]) if self.monitor in logs else None
        improved = current is not None and is_improvement(current, self.best, self.mode, 0.0)
        if self.save_best_only and not improved:
            return
        bad = self.model.nonfinite_weights()
        if bad:
            warnings.warn(f"ModelCheckpoint skipped the save at {where}: non-finite values in "
                          f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}.",
                          RuntimeWarning, stacklevel=3)
            return
        path = self._format(logs, batch)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self.model.save(path)
        if self.verbose:
            print(f"{where.capitalize()}: saved {path}"
                  + (f" ({self.monitor} = {current:.4g})" if current is not None else ""))
        if improved:
            self.best = current
        self._remember(path)

    def _format(self, logs: dict[str, float], batch: int | None) -> str:
        """The file name for this save; a missing field is a KeyError naming the choices."""
        values: dict[str, Any] = {**logs, "epoch": self._epoch + 1,
                                  "step": int(getattr(self.model, "global_step", 0))}
        if batch is not None:
            values["batch"] = batch + 1
        missing = [f for f in self._fields if f not in values]
        if missing:
            raise KeyError(f"ModelCheckpoint(filepath={self.filepath!r}) uses {{{missing[0]}}}, "
                           f"which is not available at this save. Available keys: "
                           f"{', '.join(sorted(values))}. Use one of them ('val_' keys need "
                           "validation data; 'batch' only exists with an int save_freq).")
        try:
            return self.filepath.format(**values)
        except (ValueError, TypeError) as e:
            raise ValueError(f"ModelCheckpoint(filepath={self.filepath!r}) could not be "
                             f"formatted with {values}: {e}. Fix the format spec (epoch, step "
                             "and batch are ints, log values are floats).") from e

    def _remember(self, path: str) -> None:
        """Record a complete file, then prune the oldest beyond `keep` (never the new one)."""
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        while self.keep is not None and len(self._written) > self.keep:
            old = self._written.pop(0)
            try:
                os.remove(old)
            except FileNotFoundError:
                pass

    def latest_checkpoint(self) -> str | None:
        """The newest complete file this callback wrote, else the newest matching on disk.

        The disk search globs `filepath` with every field as `*`, so it also finds files a
        previous run with the same `filepath` wrote. Returns None when there is none.
        """
        for path in reversed(self._written):
            if os.path.isfile(path):
                return path
        found = [p for p in glob.glob(_glob_pattern(self.filepath)) if os.path.isfile(p)]
        return max(found, key=os.path.getmtime) if found else None

    def state_dict(self) -> dict[str, Any]:
        """Best value, files kept and last step saved (plain types: `weights_only` loads it)."""
        return {"best": self.best, "files": list(self._written), "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run: comparisons and pruning pick up where they stopped."""
        self.best = None if state.get("best") is None else float(state["best"])
        self._written = [str(p) for p in state.get("files", [])]
        self._last_step = int(state.get("last_step", 0))


def _named_fields(filepath: str) -> list[str]:
    """The top-level field names of a format string; positional fields are a ValueError."""
    try:
        parsed = list(string.Formatter().parse(filepath))
    except ValueError as e:
        raise ValueError(f"ModelCheckpoint(filepath={filepath!r}) is not a valid format "
                         f"string: {e}. Double literal braces ({{{{ and }}}}).") from e
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = field.split(".")[0].split("[")[0]
        if not name or name.isdigit():
            raise ValueError(f"ModelCheckpoint(filepath={filepath!r}) has a positional field "
                             "{}; expected named ones such as {epoch:02d} or {val_loss:.3f}.")
        names.append(name)
    return names


def _glob_pattern(filepath: str) -> str:
    """`filepath` with literal text escaped and each field replaced by `*`."""
    return "".join(glob.escape(text) + ("*" if field is not None else "")
                   for text, field, _, _ in string.Formatter().parse(filepath))
