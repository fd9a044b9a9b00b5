"""`EMA`: an exponential moving average of the weights, updated after every optimizer step."""

from __future__ import annotations

import sys

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from fitdp.callbacks.weight_averaging import WeightAveraging
from fitdp.checks import check_int, check_number


class EMA(WeightAveraging):
    """An exponential moving average of the weights (Keras's ``use_ema``, Lightning's
    ``EMAWeightAveraging``, Composer's ``EMA``), on ``torch.optim.swa_utils`` semantics:
    after every optimizer step, ``average = decay * average + (1 - decay) * weights``, as
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` does with
    ``update_parameters(model)`` after each ``optimizer.step()`` (its first update copies the
    weights). With ``grad_accum_steps`` it averages once per optimizer step; with
    ``update_every_n_steps=N`` after every N-th (``model.global_step`` a multiple of N), as
    Lightning's ``EMAWeightAveraging(update_every_n_steps=N)``: 1/N of the cost.

    The average lives on the device the optimizer steps (never copied to the host while
    training) and in every checkpoint (a resumed fit continues it bit for bit). When ``fit``
    ends the model's parameters become the average: ``evaluate``, ``predict``, ``save``,
    ``save_weights`` and ``export`` use it. The training weights stay in
    ``ema.training_weights`` (load them back with ``model.set_weights``);
    ``model.ema_weights()`` returns the average at any time. Buffers (BatchNorm statistics)
    are not averaged: the model's own are used.

    Args:
        decay: weight of the old average at each update, in [0, 1] (0.999: an average over
            about the last 1,000 updates).
        update_every_n_steps: optimizer steps between updates (1: every step).

    Raises:
        TypeError: ``decay`` is not a number, ``update_every_n_steps`` not an int.
            ValueError: ``decay`` is outside [0, 1], ``update_every_n_steps`` below 1.

    Example:
        >>> ema = EMA(decay=0.99)
        >>> ema.decay
        0.99
    """

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1) -> None:
        super().__init__()
        self.decay = check_number("EMA(decay=...)", decay, low=0, high=1,
                                  fix="pass a number such as decay=0.999")
        self.update_every_n_steps = check_int("EMA(update_every_n_steps=...)",
                                              update_every_n_steps, 1, maximum=sys.maxsize)

    def _average_into(self, averaged: list[torch.Tensor], current: list[torch.Tensor],
                      count: torch.Tensor) -> None:
        # torch's own update, made per call (a closure would not pickle with the callback)
        get_ema_multi_avg_fn(self.decay)(averaged, current, count)

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._start()

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._catch_up()  # the last step of the previous epoch (its last partial accumulation)

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._catch_up()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        self._catch_up()
        self._swap_in()

    def _catch_up(self) -> None:
        if self._stepped() and self._last_step % self.update_every_n_steps == 0:
            self._update()

    def averaged_parameters(self) -> dict[str, torch.Tensor]:
        """Host copies of the average by name, up to the last optimizer step."""
        if self._live:
            self._catch_up()
        return super().averaged_parameters()
