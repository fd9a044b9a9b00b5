"""`TerminateOnNaN`: stop `fit` as soon as the loss is NaN or infinite."""

from __future__ import annotations

import logging

from fitdp.callbacks._monitor import is_finite
from fitdp.callbacks.base import Callback

logger = logging.getLogger("fitdp")


class TerminateOnNaN(Callback):
    """Sets `model.stop_training` when a batch's loss is NaN or infinite (Keras).

    It needs the exact loss of every batch, so it sets `sync_every_batch`: the model then reads
    the loss on the host after each batch (one device sync per batch, a small slowdown on GPU).

    Example:
        >>> stop = TerminateOnNaN()
        >>> stop.sync_every_batch
        True
    """

    sync_every_batch = True

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not is_finite(loss):
            if self._is_main_process():
                logger.warning("Batch %d: invalid loss %s, terminating training.", batch, loss)
            self.model.stop_training = True
