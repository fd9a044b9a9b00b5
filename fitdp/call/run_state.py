"""``RunState``: where a run is. The one owner of counters, positions and stop flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass
class RunState:
    """Counters and flags of a model's run, saved in checkpoints, reset per call.

    Attributes:
        epoch: the epoch in progress (after it ends, the next one: ``epoch_done``).
        epoch_done: the epoch ``epoch`` has ended (validation and callbacks included).
        global_step: optimizer steps done over the model's whole life.
        micro_step: batches accumulated since the last optimizer step (gradient
            accumulation); 0 between steps.
        batch: batches of ``epoch`` trained up to the last optimizer step.
        data_epoch: the epoch number the data source is on (equal to ``epoch`` unless
            ``steps_per_epoch`` lets an epoch end before the data does).
        stop_training, stop_evaluating, stop_predicting: set by a callback to end ``fit``,
            ``evaluate`` or ``predict`` after the current batch (Keras 3); each call starts
            with its own flag cleared.

    Example:
        >>> run = RunState()
        >>> run.begin_fit(initial_epoch=2); (run.epoch, run.batch, run.stop_training)
        (2, 0, False)
    """

    epoch: int = 0
    epoch_done: bool = False
    global_step: int = 0
    micro_step: int = 0
    batch: int = 0
    data_epoch: int = 0
    stop_training: bool = False
    stop_evaluating: bool = False
    stop_predicting: bool = False
    # The position ``begin_epoch`` left (``undo_epoch`` goes back to it); never saved.
    before_epoch: tuple[int, bool, int, int] = dataclasses.field(
        default=(0, False, 0, 0), repr=False, compare=False)

    def begin_fit(self, initial_epoch: int) -> None:
        """The state a fresh fit starts from (a resume then loads over it)."""
        self.epoch, self.epoch_done, self.batch, self.micro_step = initial_epoch, False, 0, 0
        self.data_epoch = initial_epoch
        self.stop_training = False

    def begin_epoch(self, epoch: int) -> None:
        self.before_epoch = (self.epoch, self.epoch_done, self.batch, self.data_epoch)
        if epoch != self.epoch or self.epoch_done:
            self.epoch, self.epoch_done, self.batch = epoch, False, 0

    def undo_epoch(self) -> None:
        """Back to the position before ``begin_epoch``: an epoch that trained no batch (its
        data ran out as it began) is no epoch."""
        self.epoch, self.epoch_done, self.batch, self.data_epoch = self.before_epoch

    @property
    def next_epoch(self) -> int:
        """The epoch a resumed run continues with."""
        return self.epoch + 1 if self.epoch_done else self.epoch

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: position and counters (never mid-step: a
        checkpoint is taken between optimizer steps; batches accumulated since are trained
        again on resume)."""
        return {"epoch": self.epoch, "epoch_done": self.epoch_done,
                "global_step": self.global_step, "batch": self.batch,
                "data_epoch": self.data_epoch}

    def problem(self, state: Any, checkpoint: Mapping[str, Any]) -> str | None:
        """Why ``state`` is not a run position to load, or None."""
        keys = ("epoch", "epoch_done", "global_step", "batch")
        if not isinstance(state, Mapping) or not all(isinstance(state.get(k), int)
                                                     for k in keys):
            return f"it is not a run position (integers {list(keys)})"
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.epoch_done = int(state["epoch"]), bool(state["epoch_done"])
        self.global_step, self.batch = int(state["global_step"]), int(state["batch"])
        self.data_epoch = int(state.get("data_epoch", self.epoch))
        self.micro_step = 0
