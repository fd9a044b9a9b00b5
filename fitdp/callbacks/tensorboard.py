"""`TensorBoard`: per-epoch scalars for TensorBoard, through torch's `SummaryWriter`."""

from __future__ import annotations

import importlib
import os
from typing import Any

from fitdp.callbacks.base import Callback


class TensorBoard(Callback):
    """Writes every epoch's logs as scalars: `train/<key>` and `val/<key>` (x axis: epoch).

    Training and validation values of one quantity sit under separate tags (`train/loss`,
    `val/loss`), so TensorBoard groups them in the `train` and `val` sections. The writer is
    opened at the start of training (main process only), flushed each epoch and closed at the
    end. Open the logs with `tensorboard --logdir <log_dir>`.

    Args:
        log_dir: folder for the event files.

    Raises:
        ImportError: the `tensorboard` package is not installed.
        TypeError: `log_dir` is not a non-empty string or path.

    Example:
        >>> tb = TensorBoard("runs/exp1")  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs") -> None:
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise TypeError(f"TensorBoard(log_dir=...) got {log_dir!r}; expected a non-empty "
                            "folder path such as 'runs/exp1'.")
        try:  # fail at construction, not at the end of the first epoch
            importlib.import_module("tensorboard")
        except ImportError as e:
            raise ImportError("TensorBoard needs the `tensorboard` package, which is not "
                              "installed. Install it with `pip install tensorboard`.") from e
        self.log_dir = os.fspath(log_dir)
        self._writer: Any = None

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        if self._is_main_process() and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self._writer is None:
            return
        for key, value in (logs or {}).items():
            tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            self._writer.add_scalar(tag, float(value), global_step=epoch)
        self._writer.flush()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
