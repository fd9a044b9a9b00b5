"""`CSVLogger`: one CSV row of logs per epoch."""

from __future__ import annotations

import csv
import os
from typing import IO, Any

from fitdp.callbacks.base import Callback
from fitdp.checks import check_bool, check_file_target, check_path, fail

_MISSING = "NA"  # Keras's placeholder; pandas reads it as NaN


class CSVLogger(Callback):
    """Writes `epoch` (0-based, as Keras) and every log key, sorted, one row per epoch.

    Each row is flushed as it is written, so the file can be watched during training. A key
    that first appears in a later epoch (say `val_loss` when validation starts late) gets a
    column: the file is rewritten once with the wider header (atomically) and earlier rows
    read `NA` there. Only the main process writes.

    Args:
        filename: the CSV file (its folder is created when needed).
        separator: the field delimiter, one character.
        append: keep an existing file and add rows (its header is reused, not rewritten).

    Raises:
        TypeError: `filename` is not a string or path, `separator` not a string, `append`
            not a bool.
        ValueError: `filename` is empty, a folder or under a file; `separator` is not one
            character.

    Example:
        >>> logger = CSVLogger("runs/train.csv", append=True)
        >>> logger.separator
        ','
    """

    needs_batch_logs = False  # epoch logs only

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",",
                 append: bool = False) -> None:
        super().__init__()
        self.filename = check_path("CSVLogger(filename=...)", filename)
        if not isinstance(separator, str) or len(separator) != 1:
            fail("CSVLogger(separator=...)", separator, "one character such as ',' or '\\t'",
                 error=TypeError if not isinstance(separator, str) else ValueError)
        self.separator = separator
        self.append = check_bool("CSVLogger(append=...)", append)
        check_file_target("CSVLogger(filename=...)", self.filename)
        self.keys: list[str] | None = None  # the header, "epoch" first
        self._file: IO[str] | None = None

    def check_fit(self, params: dict[str, Any]) -> None:
        """The file can still be written (a file put in its folder's place is found now)."""
        check_file_target("CSVLogger(filename=...)", self.filename)

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self.keys = None
        self._close()

    def _open(self) -> IO[str]:
        """The file, opened at the first row: a fit that fails before its first epoch ends
        leaves an earlier log as it was (Keras opens, and truncates, it at the start)."""
        folder = os.path.dirname(self.filename)
        if folder:
            os.makedirs(folder, exist_ok=True)
        if self.append and os.path.isfile(self.filename):
            with open(self.filename, newline="") as f:
                self.keys = next(csv.reader(f, delimiter=self.separator), None)
        return open(self.filename, "a" if self.append and self.keys else "w", newline="")

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if not self._is_main_process():
            return
        if self._file is None:
            self._file = self._open()
        logs = logs or {}
        if self.keys is None:
            self.keys = ["epoch"] + sorted(logs)
            self._writer(self._file).writeheader()
        elif any(k not in self.keys for k in logs):
            self._file = self._widen(self._file, self.keys, logs)
        row: dict[str, Any] = {k: float(v) for k, v in logs.items()}
        row["epoch"] = epoch
        self._writer(self._file).writerow(row)
        self._file.flush()

    def _writer(self, file: IO[str]) -> csv.DictWriter[str]:
        """A writer over `file` with the current header."""
        return csv.DictWriter(file, fieldnames=self.keys or [], delimiter=self.separator,
                              restval=_MISSING, extrasaction="ignore")

    def _widen(self, file: IO[str], old: list[str], logs: dict[str, float]) -> IO[str]:
        """Rewrite the file with a wider header (old rows get NA there); return it reopened."""
        file.close()
        with open(self.filename, newline="") as f:
            rows = list(csv.DictReader(f, delimiter=self.separator))
        self.keys = ["epoch"] + sorted((set(old) | set(logs)) - {"epoch"})
        tmp = f"{self.filename}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = self._writer(f)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.filename)  # a crash mid-rewrite leaves the old, narrower file
        return open(self.filename, "a", newline="")

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
