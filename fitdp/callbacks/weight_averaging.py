"""`WeightAveraging`, what `EMA` and `SWA` share: an average of the weights kept where the
optimizer steps them, as ``torch.optim.swa_utils.AveragedModel`` keeps it, saved with every
checkpoint and loaded into the model when ``fit`` ends."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from fitdp.callbacks.base import Callback


class WeightAveraging(Callback):
    """Base of `EMA` and `SWA`: an average of the model's parameters on the device the
    optimizer steps (device 0's replica; every replica equals it after a step), never copied
    to the host during training.

    Like ``AveragedModel(model, use_buffers=False)``, the first update copies the parameters
    and later ones call ``_average_into(averaged, current, n_averaged)``, one call per dtype, with
    ``n_averaged`` a tensor on the average's device (no host sync per step); buffers
    (BatchNorm statistics) are not averaged: the model's own are used with the average.

    The average, its count and the last optimizer step it saw are this callback's checkpoint
    state: a fit resumed from any checkpoint, even one taken in the middle of an epoch,
    continues it bit for bit. When ``fit`` ends, the model's parameters become the average
    (so ``evaluate``, ``predict``, ``save``, ``save_weights`` and ``export`` use it); the
    training weights are kept in ``training_weights`` (host copies). ``model.ema_weights()``
    returns the average at any time.
    """

    needs_batch_logs = False  # counts optimizer steps; never reads the logs

    def __init__(self) -> None:
        super().__init__()
        self._names: list[str] = []
        self._current: list[torch.Tensor] = []  # the parameters the optimizer steps (live)
        self._average: list[torch.Tensor] = []
        self._count: torch.Tensor | None = None  # AveragedModel.n_averaged, on their device
        self._n = 0  # the same count on the host: decides the first copy without a sync
        self._last_step = 0
        self._live = False  # between on_train_begin and the end of fit
        self.training_weights: dict[str, torch.Tensor] | None = None

    def _average_into(self, averaged: list[torch.Tensor], current: list[torch.Tensor],
                      count: torch.Tensor) -> None:
        """Fold ``current`` into ``averaged`` in place, ``count`` updates in (one dtype): the
        equal-weight average, ``AveragedModel``'s own choice when given no averaging function
        (SWA's); `EMA` overrides it."""
        if foreach_on(count.device):
            get_swa_multi_avg_fn()(averaged, current, count)
            return
        avg_fn = get_swa_avg_fn()
        for avg, cur in zip(averaged, current):
            avg.copy_(avg_fn(avg, cur, count))

    # -- the average ---------------------------------------------------------------------

    def _start(self) -> None:
        """A fresh average of the parameters the optimizer steps (its first update copies)."""
        model = self.model
        if getattr(model, "shards_weights", False):
            raise ValueError(
                f"callbacks: got {type(self).__name__} with strategy='fsdp'; expected whole "
                "weights on each rank (FSDP2 shards them). Fix: compile(strategy='ddp' or "
                "'auto') to average the weights, or drop the callback.")
        named = model.device_parameters()
        self._names = list(named)
        # The parameters themselves, not aliases of their storage: a load may re-point them.
        self._current = list(named.values())
        # Not filled: the first update copies (AveragedModel's n_averaged == 0 case).
        self._average = [torch.empty_like(p) for p in self._current]
        device = self._current[0].device if self._current else torch.device("cpu")
        self._count = torch.zeros((), dtype=torch.long, device=device)
        self._n = 0
        self._last_step = int(model.global_step)
        self._live = True
        self.training_weights = None

    @torch.no_grad()
    def _update(self) -> None:
        """``AveragedModel.update_parameters``: the current parameters into the average."""
        count = self._count
        assert count is not None  # noqa: S101 - on_train_begin made it
        if self._n == 0:
            for avg, cur in zip(self._average, self._current):
                avg.copy_(cur)
        else:
            for dtype in dict.fromkeys(t.dtype for t in self._average):
                pairs = [(a, c) for a, c in zip(self._average, self._current)
                         if a.dtype == dtype]
                self._average_into([a for a, _ in pairs], [c for _, c in pairs], count)
        count += 1
        self._n += 1

    def _stepped(self) -> bool:
        """Whether the optimizer stepped since the last look (at most once: every batch
        looks). Averaging lazily, before the next batch and at the end, rather than right
        after the step means a checkpoint written by any callback at any point resumes
        the same average: the step's weights are still there to average."""
        step = int(self.model.global_step)
        stepped, self._last_step = step != self._last_step, step
        return stepped

    def averaged_parameters(self) -> dict[str, torch.Tensor]:
        """Host copies of the averaged parameters by name (empty before the first update)."""
        if not self._n:
            return {}
        return {name: t.to("cpu", copy=True) for name, t in zip(self._names, self._average)}

    def _swap_in(self) -> None:
        """Make the average the model's parameters (every replica's and the host's), keeping
        host copies of the training weights in ``training_weights``. The average moves to
        the host: the replicas (and their device memory) may go once fit has ended."""
        self._live = False
        self._current = []
        if self._n:  # (else nothing was averaged: the training weights stay)
            weights = self.model.get_weights()
            self.training_weights = weights
            averaged = dict(weights)
            averaged.update(zip(self._names, self._average))
            self.model.set_weights(averaged)
        self._average = [t.cpu() for t in self._average]

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The average (tensors on their device: a save copies them to the file), its count
        and the last optimizer step it saw."""
        if self._count is None:
            return {}
        average = dict(zip(self._names, self._average)) if self._n else None
        return {"average": average, "n_averaged": self._count, "n": self._n,
                "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (after `on_train_begin` made a fresh average)."""
        if self._count is None or "n_averaged" not in state:
            return
        average = state["average"] or {}
        with torch.no_grad():
            for name, avg in zip(self._names, self._average):
                if name in average:
                    avg.copy_(average[name])
            self._count.copy_(state["n_averaged"])
        self._n = int(state["n"])
        self._last_step = int(state["last_step"])


def foreach_on(device: torch.device) -> bool:
    """Whether ``AveragedModel`` averages tensors on ``device`` with the foreach kernels (its
    own test: CUDA and the like, not the CPU)."""
    return device.type in _get_foreach_kernels_supported_devices()
