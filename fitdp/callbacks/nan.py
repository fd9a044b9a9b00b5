"""`TerminateOnNaN`: stop `fit` as soon as the loss is NaN or infinite."""

from __future__ import annotations

import logging

from fitdp.callbacks._monitored_value import is_finite
from fitdp.callbacks.base import Callback
from fitdp.checks import check_bool

logger = logging.getLogger("fitdp")


class TerminateOnNaN(Callback):
    """Stops training at the first batch whose loss is NaN or infinite (Keras).

    By default it sets `model.stop_training`: the epoch ends after this batch, and
    `on_train_end` of every callback runs as after any early stop. With `raise_error=True` it
    raises a `RuntimeError` instead, so `fit` fails at once and no `on_train_end` runs (a
    `BackupAndRestore` keeps its backup, for instance), as in Keras 3.

    It needs the exact loss of every batch, so it sets `sync_every_batch`: the model then reads
    the loss on the host after each batch (one device sync per batch, a small slowdown on GPU).

    Args:
        raise_error: raise a RuntimeError instead of stopping gracefully.

    Raises:
        RuntimeError: (at a batch end) the loss is NaN or infinite and `raise_error` is True.

    Example:
        >>> stop = TerminateOnNaN(raise_error=True)
        >>> stop.sync_every_batch, stop.raise_error
        (True, True)
    """

    sync_every_batch = True

    def __init__(self, raise_error: bool = False) -> None:
        super().__init__()
        self.raise_error = check_bool("TerminateOnNaN(raise_error=...)", raise_error)

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is None or is_finite(loss):
            return
        if self.raise_error:
            # Keras 3's own words (keras/src/callbacks/terminate_on_nan.py), so code that
            # matches the message keeps working; fitdp adds what does not run.
            raise RuntimeError(f"NaN or Inf loss encountered at batch {batch}. Loss value: "
                               f"{loss}. Terminating training immediately (TerminateOnNaN: "
                               "on_train_end does not run).")
        if self._is_main_process():
            logger.warning("Batch %d: invalid loss %s, terminating training.", batch, loss)
        self.model.stop_training = True
