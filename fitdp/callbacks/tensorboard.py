"""`TensorBoard`: scalars and weight histograms for TensorBoard, through torch's `SummaryWriter`."""

from __future__ import annotations

import importlib
import os
from typing import Any

from fitdp.callbacks.base import Callback
from fitdp.checks import check_int, fail


class TensorBoard(Callback):
    """Writes every epoch's logs as scalars: `train/<key>` and `val/<key>` (x axis: epoch).

    Training and validation values of one quantity sit under separate tags (`train/loss`,
    `val/loss`), so TensorBoard groups them in the `train` and `val` sections. With
    `update_freq` set to "batch" or N, the batch logs are written too, as `train_batch/<key>`
    every N training batches (x axis: the batches this callback has seen in the run, as in
    Keras). With `histogram_freq=N`, every N epochs (from the first) each floating-point
    weight of `model.get_weights()` is written as the histogram `weights/<name>` (one copy
    of the weights to the host, averaged over the devices). The writer is opened at the start
    of training (main process only), flushed each epoch and closed at the end. Open the logs
    with `tensorboard --logdir <log_dir>`.

    Args:
        log_dir: folder for the event files.
        histogram_freq: write weight histograms every this many epochs; 0 never.
        update_freq: "epoch" (epoch scalars only), "batch" (also every batch) or an int N
            (also every N batches).

    Raises:
        ImportError: the `tensorboard` package is not installed.
        TypeError: `log_dir` is not a non-empty string or path; `histogram_freq` not an int.
        ValueError: a negative `histogram_freq`, or an `update_freq` not of the above.

    Example:
        >>> tb = TensorBoard("runs/exp1", update_freq=100, histogram_freq=1)  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", histogram_freq: int = 0,
                 update_freq: str | int = "epoch") -> None:
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            fail("TensorBoard(log_dir=...)", log_dir,
                 "a non-empty folder path such as 'runs/exp1'", error=TypeError)
        self.histogram_freq = check_int("TensorBoard(histogram_freq=...)", histogram_freq, 0)
        self.update_freq = check_update_freq(update_freq, "TensorBoard")
        try:  # fail at construction, not at the end of the first epoch
            importlib.import_module("tensorboard")
        except ImportError as e:
            raise ImportError("TensorBoard needs the `tensorboard` package, which is not "
                              "installed. Install it with `pip install tensorboard`.") from e
        self.log_dir = os.fspath(log_dir)
        # Batch scalars are plotted per batch: they should be that batch's values.
        self.needs_batch_logs = self.update_freq != "epoch"
        self._writer: Any = None
        self._batches = 0

    @property
    def state_key(self) -> str:
        """`TensorBoard[<log_dir>]`."""
        return f"TensorBoard[{self.log_dir}]"

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._batches = 0
        if self._is_main_process() and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.update_freq == "epoch":
            return
        self._batches += 1
        if self._writer is None or self._batches % int(self.update_freq):
            return
        for key, value in (logs or {}).items():
            self._writer.add_scalar(f"train_batch/{key}", float(value),
                                    global_step=self._batches)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self._writer is None:
            return
        for key, value in (logs or {}).items():
            tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            self._writer.add_scalar(tag, float(value), global_step=epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            for name, tensor in self.model.get_weights().items():
                if tensor.is_floating_point() and tensor.numel():
                    self._writer.add_histogram(f"weights/{name}", tensor.float(),
                                               global_step=epoch)
        self._writer.flush()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def state_dict(self) -> dict[str, Any]:
        """The batch count, so a resumed run's batch scalars continue the x axis."""
        return {"batches": self._batches} if self.update_freq != "epoch" else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self._batches = int(state.get("batches", 0))


def check_update_freq(update_freq: Any, owner: str) -> str | int:
    """"epoch", or the batch interval: "batch" is 1 (Keras); ``owner`` names the callback."""
    if isinstance(update_freq, str) and update_freq in ("epoch", "batch"):
        return 1 if update_freq == "batch" else "epoch"
    if isinstance(update_freq, str):
        fail(f"{owner}(update_freq=...)", update_freq, "'epoch', 'batch' or an int >= 1")
    return check_int(f"{owner}(update_freq=...)", update_freq, 1,
                     fix="pass 'epoch', 'batch' or an int >= 1")
