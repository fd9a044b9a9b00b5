"""`ModelCheckpoint`: save the model every epoch or N batches, optionally only when it improves."""

from __future__ import annotations

import glob
import os
import string
import warnings
from typing import Any

from fitdp.callbacks._monitored_value import (
    is_finite,
    is_improvement,
    monitor_key,
    monitor_value,
    resolve_mode,
)
from fitdp.callbacks._save_freq import BatchCounter, check_save_freq
from fitdp.callbacks.base import Callback
from fitdp.checks import (
    check_bool,
    check_file_target,
    check_int,
    check_number,
    check_path_arg,
    fail,
)
from fitdp.saving.sharded import is_checkpoint, remove_checkpoint


class ModelCheckpoint(Callback):
    """Saves full checkpoints with `model.save` (or weights only), Keras style.

    `filepath` is formatted at each save with `epoch` (1-based, as in Keras), `step` (the
    optimizer steps done, `model.global_step`), `batch` (1-based, step-frequency saves only)
    and every key of the logs of the epoch or batch saved, for example
    `"ckpt-{epoch:02d}-{val_loss:.3f}.ckpt"` or `"c-{epoch}-{batch}-{loss:.3f}.ckpt"`. A save
    is skipped with a warning when the monitored value or the loss is NaN/inf, or when any
    weight is non-finite, so a diverged run never overwrites a good checkpoint. Only the main
    process writes, prints and prunes; with `strategy="fsdp"` every rank takes part in each
    save (each writes its shards: a checkpoint is then a folder, see `Model.save`).

    Args:
        filepath: path template, `str.format` style with named fields only.
        monitor: the log key compared for `save_best_only` and tracked in `best`.
        mode: "min", "max" or "auto" (max for keys naming accuracy, AUC, precision, recall,
            F1 and similar scores; min otherwise and for anything naming a loss or error).
        save_best_only: save only when `monitor` improves on the best value so far. When
            `monitor` is missing from the logs it warns and saves (Keras).
        save_freq: "epoch" (at each epoch end) or an int N: every N training batches this
            callback has seen (Keras; counted across epochs, restarted by each fit).
        keep: keep only the newest `keep` files this callback wrote; an old file is removed
            only after a newer one is complete (durable). None keeps all.
        verbose: 1 prints a line for each save.
        save_weights_only: save with `model.save_weights` (weights only, no optimizer state:
            such files cannot resume a run, so `latest_checkpoint()` ignores them).
        initial_value_threshold: the `best` value to beat before the first save with
            `save_best_only` (Keras).
        async_save: `model.save(path, async_save=True)`: the step copies the state to host
            memory and training goes on while a background thread writes it.

    Raises:
        TypeError: `filepath` is not a string or path; `keep` is not an int.
        ValueError: a bad `mode`, `save_freq`, `keep` or `initial_value_threshold`, a
            `filepath` with positional fields, or `async_save` with `save_weights_only`.

    Example:
        >>> ckpt = ModelCheckpoint("runs/ckpt-{epoch:02d}-{val_loss:.3f}.ckpt",
        ...                        save_best_only=True, keep=3)
        >>> ckpt.mode, ckpt.state_key
        ('min', 'ModelCheckpoint[runs/ckpt-{epoch:02d}-{val_loss:.3f}.ckpt]')
    """

    state_field = "filepath"

    def __init__(self, filepath: str | os.PathLike[str], monitor: str = "val_loss",
                 mode: str = "auto", save_best_only: bool = False,
                 save_freq: str | int = "epoch", keep: int | None = None,
                 verbose: int = 0, *, save_weights_only: bool = False,
                 initial_value_threshold: float | None = None,
                 async_save: bool = False) -> None:
        super().__init__()
        self.filepath = check_path_arg("ModelCheckpoint(filepath=...)", filepath,
                                       "'runs/ckpt-{epoch:02d}.ckpt'")
        self._fields = _named_fields(self.filepath)
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode, "ModelCheckpoint")
        self.save_best_only = check_bool("ModelCheckpoint(save_best_only=...)", save_best_only)
        self.save_freq = check_save_freq(save_freq, "ModelCheckpoint", "training batches")
        self.keep = None if keep is None else check_int("ModelCheckpoint(keep=...)", keep, 1)
        self.verbose = verbose
        self.save_weights_only = check_bool("ModelCheckpoint(save_weights_only=...)",
                                            save_weights_only)
        self.async_save = check_bool("ModelCheckpoint(async_save=...)", async_save)
        if self.async_save and self.save_weights_only:
            fail("ModelCheckpoint(async_save=...)", True, "False with save_weights_only=True",
                 "async_save writes full checkpoints; drop one of the two")
        self.initial_value_threshold = None if initial_value_threshold is None else \
            check_number("ModelCheckpoint(initial_value_threshold=...)",
                         initial_value_threshold)
        # Step-frequency saves name and judge the step they save by its exact logs.
        self.needs_batch_logs = self.save_freq != "epoch"
        self.best: float | None = self.initial_value_threshold
        self._written: list[str] = []
        self._pending: str | None = None  # an async save not known to be durable yet
        self._counter = BatchCounter(self.save_freq if self.save_freq != "epoch" else 1)
        self._epoch = 0

    def check_fit(self, params: dict[str, Any]) -> None:
        """`filepath`'s fields exist in this fit's logs (`val_` keys need validation data,
        `batch` an int `save_freq`), its format specs fit their values, and its folder can
        be made: checked with stand-in values before the first step, not at the first save."""
        name = "ModelCheckpoint(filepath=...)"
        missing = [f for f in self._fields if (f.startswith("val_") and not params.get(
            "validates")) or (f == "batch" and self.save_freq == "epoch")]
        if missing:
            fail(name, self.filepath, f"fields this fit's logs have ({{{missing[0]}}} is not "
                 "one: 'val_' keys need validation data, 'batch' an int save_freq)",
                 "pass validation_data= (or validation_split=), save_freq=N, or drop the "
                 "field")
        values: dict[str, Any] = {f: 1.0 for f in self._fields}
        values.update(epoch=1, step=1, batch=1)
        try:
            path = self.filepath.format(**values)
        except (ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
            fail(name, self.filepath, f"format specs that fit the values (epoch, step and "
                 f"batch are ints, log values floats): {type(e).__name__}: {e}",
                 "e.g. {epoch:02d} and {val_loss:.3f}")
        check_file_target(name, path)

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        # `best` carries over between fits, as in Keras; the batch count restarts.
        self._counter.reset()
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.save_freq != "epoch" and self._counter.due(batch):
            self._save(logs, batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._epoch = epoch
        if self.save_freq == "epoch":
            self._save(logs, None)

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self._pending is not None:
            self.model.wait_for_saves()  # raises the error of a failed background save
            self._pending = None
            self._prune()

    def _save(self, logs: dict[str, float] | None, batch: int | None) -> None:
        """Save unless something is non-finite or (`save_best_only`) nothing improved.
        FSDP2: every rank runs this (the save is a collective), with the same logs."""
        if not self.save_weights_only:
            self._share_logs()  # every rank: the checkpoint holds each rank's running logs
        if not self._takes_part_in_saves():
            return
        main = self._is_main_process()
        logs = dict(logs or {})
        where = f"epoch {self._epoch + 1}" + ("" if batch is None else f", batch {batch + 1}")
        for key in dict.fromkeys((monitor_key(logs, self.monitor), "loss")):
            if key in logs and not is_finite(logs[key]):
                if main:
                    warnings.warn(f"ModelCheckpoint skipped the save at {where}: {key} is "
                                  f"{logs[key]}; a diverged model must not replace a good "
                                  "checkpoint.", UserWarning, stacklevel=3)
                return
        if self.save_best_only:
            current = monitor_value(logs, self.monitor, "ModelCheckpoint(save_best_only=True)")
        else:
            key = monitor_key(logs, self.monitor)
            current = float(logs[key]) if key in logs else None
        improved = current is not None and is_improvement(current, self.best, self.mode, 0.0)
        if self.save_best_only and current is not None and not improved:
            return
        bad = self.model.nonfinite_weights()  # (FSDP2: a collective)
        if bad:
            if main:
                warnings.warn(f"ModelCheckpoint skipped the save at {where}: non-finite "
                              f"values in {', '.join(bad[:5])}"
                              f"{' ...' if len(bad) > 5 else ''}.", UserWarning, stacklevel=3)
            return
        path = self._format(logs, batch)
        folder = os.path.dirname(path)
        if folder and main:
            os.makedirs(folder, exist_ok=True)
        if improved:
            self.best = current
        # Listed before saving, so the checkpoint's own copy of this state lists its file.
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        self._write(path)
        if self.verbose and main:
            print(f"{where.capitalize()}: saved {path}"
                  + (f" ({self.monitor} = {current:.4g})" if current is not None else ""))
        self._prune()

    def _write(self, path: str) -> None:
        """One save; an async one makes the previous async save durable (one in flight)."""
        if self.save_weights_only:
            self.model.save_weights(path)
        elif self.async_save:
            self.model.save(path, async_save=True)
            self._pending = path
        else:
            self.model.save(path)

    def _format(self, logs: dict[str, float], batch: int | None) -> str:
        """The file name for this save; a missing field is a KeyError naming the choices."""
        values: dict[str, Any] = {**logs, "epoch": self._epoch + 1,
                                  "step": int(getattr(self.model, "global_step", 0))}
        if batch is not None:
            values.setdefault("batch", batch + 1)
        missing = [f for f in self._fields if f not in values]
        if missing:
            raise KeyError(f"ModelCheckpoint(filepath={self.filepath!r}) uses {{{missing[0]}}}, "
                           f"which is not available at this save. Available keys: "
                           f"{', '.join(sorted(values))}. Use one of them ('val_' keys need "
                           "validation data; 'batch' only exists with an int save_freq).")
        try:
            return self.filepath.format(**values)
        except (ValueError, TypeError) as e:
            fail("ModelCheckpoint(filepath=...)", self.filepath, f"format specs that fit "
                 f"{values} ({e})", "epoch, step and batch are ints, log values are floats")

    def _prune(self) -> None:
        """Remove the oldest files beyond `keep`, counting only durable ones: a file goes
        only once `keep` newer files are complete."""
        durable = [p for p in self._written if p != self._pending]
        while self.keep is not None and len(durable) > self.keep:
            old = durable.pop(0)
            self._written.remove(old)
            if self._is_main_process():
                remove_checkpoint(old)  # a file, or a sharded checkpoint's folder

    def latest_checkpoint(self) -> str | None:
        """The newest complete file this callback wrote, else the newest matching on disk.

        The disk search globs `filepath` with every field as `*`, so it also finds files a
        previous run with the same `filepath` wrote. Returns None when there is none, and
        with `save_weights_only` (weights files cannot resume a run).
        """
        if self.save_weights_only:
            return None
        for path in reversed(self._written):
            if is_checkpoint(path):
                return path
        found = [p for p in glob.glob(_glob_pattern(self.filepath)) if is_checkpoint(p)]
        return max(found, key=os.path.getmtime) if found else None

    def state_dict(self) -> dict[str, Any]:
        """Best value, files kept and the batch count (plain types: `weights_only` loads it)."""
        return {"best": self.best, "files": list(self._written),
                "batches": self._counter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run: comparisons, pruning and the save cadence pick up where
        they stopped."""
        self.best = None if state.get("best") is None else float(state["best"])
        self._written = [str(p) for p in state.get("files", [])]
        self._counter.load_state_dict(state.get("batches", {}))


def _named_fields(filepath: str) -> list[str]:
    """The top-level field names of a format string; positional fields are a ValueError."""
    try:
        parsed = list(string.Formatter().parse(filepath))
    except ValueError as e:
        fail("ModelCheckpoint(filepath=...)", filepath, f"a valid format string ({e})",
             "double literal braces ({{ and }})")
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = field.split(".")[0].split("[")[0]
        if not name or name.isdigit():
            fail("ModelCheckpoint(filepath=...)", filepath,
                 "named fields such as {epoch:02d} or {val_loss:.3f}, not positional ones {}")
        names.append(name)
    return names


def _glob_pattern(filepath: str) -> str:
    """`filepath` with literal text escaped and each field replaced by `*`."""
    return "".join(glob.escape(text) + ("*" if field is not None else "")
                   for text, field, _, _ in string.Formatter().parse(filepath))
