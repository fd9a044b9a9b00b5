"""When the saving callbacks save: `save_freq` checks and the batch and step counters."""

from __future__ import annotations

import numbers
from typing import Any, Literal

from fitdp.checks import fail


def check_save_freq(save_freq: Any, owner: str, unit: str) -> Literal["epoch"] | int:
    """Return "epoch" or a positive int; anything else is a ValueError naming the fix."""
    if save_freq == "epoch" and isinstance(save_freq, str):
        return "epoch"
    if isinstance(save_freq, numbers.Integral) and not isinstance(save_freq, bool) \
            and int(save_freq) > 0:
        return int(save_freq)
    fail(f"{owner}(save_freq=...)", save_freq,
         f"'epoch' (save at each epoch end) or a positive int N (save every N {unit})",
         error=ValueError)


class BatchCounter:
    """Keras's `_batches_seen_since_last_saving`: counts the training batches a callback has
    seen, from the batch indices it is called with, and says when `every` have passed.

    A batch index not above the last one seen starts a new epoch (it counts `batch + 1`), so
    a run resumed mid-epoch with the restored state counts on where it stopped.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.reset()

    def reset(self) -> None:
        """Start counting from zero (a new run)."""
        self.seen = 0
        self.last_batch: int | None = None

    def due(self, batch: int) -> bool:
        """Count `batch`; True (and the count restarts) once `every` batches were seen."""
        if self.last_batch is None or batch <= self.last_batch:
            self.seen += batch + 1  # a new epoch: batches are 0-based
        else:
            self.seen += batch - self.last_batch
        self.last_batch = batch
        if self.seen >= self.every:
            self.seen = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """The count and last batch index (plain ints: loads with `weights_only=True`)."""
        return {"seen": self.seen, "last_batch": self.last_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue counting where a saved run stopped."""
        self.seen = int(state.get("seen", 0))
        last = state.get("last_batch")
        self.last_batch = None if last is None else int(last)


def step_save_due(save_freq: str | int, step: int, last: int) -> bool:
    """Whether a ``save_freq=N`` save is due after optimizer step ``step``: once per step (with
    gradient accumulation several batches share one), never for ``save_freq="epoch"``."""
    return save_freq != "epoch" and step > 0 and step % int(save_freq) == 0 and step != last
