"""`SWA`: stochastic weight averaging, torch's recipe (``AveragedModel``, ``SWALR``,
``update_bn``) as a callback."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

from torch.optim.swa_utils import SWALR

from fitdp.callbacks.weight_averaging import WeightAveraging
from fitdp.checks import check_choice, check_int, check_number, fail


class SWA(WeightAveraging):
    """Stochastic weight averaging (Izmailov et al. 2018; Lightning's
    ``StochasticWeightAveraging``), as ``torch.optim.swa_utils``'s recipe runs it:

    - from epoch ``swa_epoch_start`` on, ``SWALR(optimizer, swa_lr, annealing_epochs,
      annealing_strategy)`` sets the learning rate, stepped once per epoch (it anneals from
      the rate it finds to ``swa_lr`` over ``annealing_epochs`` epochs, then holds it);
    - at the end of each of those epochs, ``AveragedModel.update_parameters`` adds the
      weights to an equal-weight average (kept on the device the optimizer steps);
    - when ``fit`` ends, the average becomes the model's parameters and BatchNorm running
      statistics are computed for it over the training data, as ``update_bn`` does: one
      pass in training mode with cumulative statistics (the whole batches, on one device,
      so any device count gives the one-device statistics).

    ``evaluate``, ``predict``, ``save``, ``save_weights`` and ``export`` then use the
    averaged weights; the training weights stay in ``swa.training_weights`` (host copies);
    ``model.ema_weights()`` returns the average (during fit: with the model's current
    BatchNorm statistics). The average, its count and the schedule's position are in every
    checkpoint: a resumed fit continues bit for bit. A ``compile(lr_scheduler=...)`` keeps
    stepping during the SWA epochs, and SWALR anneals from the rate it leaves: end it
    before ``swa_epoch_start`` (torch's recipe stops it there).

    Args:
        swa_lr: the learning rate SWA anneals to, or one per parameter group.
        swa_epoch_start: the first SWA epoch: an int (0-based epoch index), or a float in
            [0, 1): that fraction of ``fit``'s ``epochs`` (0.8 of 10 epochs: epoch 8).
        annealing_epochs: epochs over which the rate goes to ``swa_lr`` (0: at once).
        annealing_strategy: ``"cos"`` or ``"linear"``.

    Raises:
        TypeError: an argument of the wrong type. ValueError: ``swa_lr`` not > 0,
            ``swa_epoch_start`` negative or a float outside [0, 1), ``annealing_epochs``
            negative, another ``annealing_strategy``; when ``fit`` checks its arguments:
            ``swa_epoch_start`` at or after ``fit``'s ``epochs``, ``swa_lr``'s rates not
            one per parameter group.

    Example:
        >>> swa = SWA(swa_lr=0.05, swa_epoch_start=0.75)
        >>> swa.swa_lr, swa.swa_epoch_start
        (0.05, 0.75)
    """

    def __init__(self, swa_lr: float | Sequence[float], swa_epoch_start: int | float = 0.8,
                 annealing_epochs: int = 10, annealing_strategy: str = "cos") -> None:
        super().__init__()
        self.swa_lr = _check_swa_lr(swa_lr)
        self.swa_epoch_start = _check_epoch_start(swa_epoch_start)
        self.annealing_epochs = check_int("SWA(annealing_epochs=...)", annealing_epochs, 0)
        self.annealing_strategy = check_choice("SWA(annealing_strategy=...)",
                                               annealing_strategy, ("cos", "linear"))
        self._first = 0  # swa_epoch_start as an epoch of this fit
        self._epoch: int | None = None  # the epoch being trained
        self._averaged_epoch: int | None = None  # the last epoch in the average
        self._scheduler: SWALR | None = None
        self._lr_steps: int | None = None  # SWALR steps taken (None: not started)
        self._lr_epoch: int | None = None  # the last epoch SWALR set the rate for

    def check_fit(self, params: dict[str, Any]) -> None:
        """``swa_epoch_start`` is an epoch this fit trains (else nothing would be averaged,
        and the model would end as trained), and ``swa_lr`` has a rate per parameter group."""
        epochs = params["epochs"]
        start = self.swa_epoch_start
        first = start if isinstance(start, int) else int(start * epochs)
        if first >= epochs:
            fail("SWA(swa_epoch_start=...)", start, f"an epoch this fit trains: below "
                 f"epochs={epochs}" + ("" if isinstance(start, int) else f" (a fraction: "
                                       f"{start} of {epochs} epochs is epoch {first})"),
                 f"pass swa_epoch_start < {epochs} (or a fraction such as 0.8), or train "
                 "more epochs")
        groups = self.model.optimizer.param_groups if self.model.optimizer else []
        if isinstance(self.swa_lr, list) and len(self.swa_lr) != len(groups):
            fail("SWA(swa_lr=...)", self.swa_lr, f"one rate per parameter group "
                 f"({len(groups)} here)", "pass a single float, or one per group")

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._start()
        start = self.swa_epoch_start
        self._first = start if isinstance(start, int) else int(start * self.params["epochs"])
        self._epoch = self._averaged_epoch = self._lr_steps = self._lr_epoch = None
        self._scheduler = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        # The previous epoch's last weights are still the model's: averaged here rather
        # than in on_epoch_end, so a checkpoint another callback writes then resumes alike.
        if self._epoch is not None and self._epoch < epoch:
            self._average_epoch(self._epoch)
        self._epoch = epoch
        if epoch >= self._first:
            self._anneal(epoch)

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self._epoch is not None:
            self._average_epoch(self._epoch)
        self._swap_in()
        if self._n:
            self.model.update_bn()

    def _average_epoch(self, epoch: int) -> None:
        if epoch >= self._first and epoch != self._averaged_epoch:
            self._update()
            self._averaged_epoch = epoch

    def _anneal(self, epoch: int) -> None:
        """SWALR made at the first SWA epoch (its first step keeps the rate), remade on
        resume at its saved position, and stepped once at the start of each later epoch."""
        if self._scheduler is None:
            self._scheduler = SWALR(self.model.optimizer, self.swa_lr,  # type: ignore[arg-type]
                                    self.annealing_epochs, self.annealing_strategy)
            if self._lr_steps is None:
                self._lr_steps, self._lr_epoch = 0, epoch
            else:  # resumed: the optimizer holds the rate of its last step
                state = self._scheduler.state_dict()  # its public form of the position
                state.update(_step_count=self._lr_steps + 1, last_epoch=self._lr_steps)
                self._scheduler.load_state_dict(state)
        if self._lr_epoch is not None and self._lr_epoch < epoch:
            if self._lr_steps or getattr(self._scheduler.optimizer, "_opt_called", False):
                self._scheduler.step()  # torch warns of the order only before both stepped
            else:
                with warnings.catch_warnings():  # (process-wide: entered only when needed)
                    # A scheduler remade on resume has not seen this run's optimizer steps:
                    # torch would warn that it steps before the optimizer, which it does not.
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step",
                                            UserWarning)
                    self._scheduler.step()
            self._lr_steps = (self._lr_steps or 0) + 1
            self._lr_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state.update(epoch=self._epoch, averaged_epoch=self._averaged_epoch,
                         lr_steps=self._lr_steps, lr_epoch=self._lr_epoch)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "lr_steps" in state:
            self._epoch, self._averaged_epoch = state["epoch"], state["averaged_epoch"]
            self._lr_steps, self._lr_epoch = state["lr_steps"], state["lr_epoch"]


def _check_swa_lr(swa_lr: Any) -> float | list[float]:
    name = "SWA(swa_lr=...)"
    fix = "pass the rate SWA anneals to, e.g. swa_lr=0.05 (or one per parameter group)"
    if isinstance(swa_lr, (list, tuple)) and swa_lr:
        return [check_number(name, v, low=0, low_open=True, fix=fix) for v in swa_lr]
    return check_number(name, swa_lr, low=0, low_open=True, fix=fix)


def _check_epoch_start(start: Any) -> int | float:
    name = "SWA(swa_epoch_start=...)"
    expected = "an epoch index (int >= 0) or a fraction of the epochs (float in [0, 1))"
    fix = "e.g. swa_epoch_start=0.8 (the last 20% of the epochs) or swa_epoch_start=5"
    if isinstance(start, bool) or not isinstance(start, numbers.Real):
        fail(name, start, expected, fix, error=TypeError)
    if isinstance(start, numbers.Integral):
        return check_int(name, start, 0, fix=fix)
    if not 0 <= float(start) < 1:
        fail(name, start, expected, fix)
    return float(start)
