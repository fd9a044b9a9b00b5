"""A fake model with exactly the part of `fitdp.Model` callbacks may use, and drivers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fitdp.callbacks import Callback
from fitdp.saving.checkpoint import save_checkpoint


class FakeModel:
    """The callback contract of `fitdp.Model`: flags, optimizer, saves, weights.

    An async save is held in memory and written by the next `save` or `wait_for_saves`, as a
    background writer that takes its time would be; `fail_async` makes that write fail, and
    the error surfaces there, as the contract says.
    """

    def __init__(self, lrs: tuple[float, ...] = (0.1,), lr_scheduler: Any = None) -> None:
        torch.manual_seed(0)
        self._net = nn.Linear(3, 2)
        params = list(self._net.parameters())
        groups = [{"params": [p], "lr": lr} for p, lr in zip(params, lrs)]
        self.optimizer = torch.optim.SGD(groups, lr=lrs[0])
        self.lr_scheduler = lr_scheduler
        self.stop_training = False
        self.is_main_process = True
        self.global_step = 0
        self.saved: list[str] = []  # paths of save() calls, in order
        self.weights_saved: list[str] = []
        self.fail_async = False
        self._in_flight: tuple[str, dict[str, Any]] | None = None

    def _state(self) -> dict[str, Any]:
        return {"weights": self.get_weights(), "step": self.global_step}

    def save(self, path: str, *, async_save: bool = False) -> None:
        self.wait_for_saves()  # at most one save in flight
        self.saved.append(path)
        if async_save:
            self._in_flight = (path, self._state())  # the host snapshot
        else:
            save_checkpoint(path, self._state())

    def wait_for_saves(self) -> None:
        if self._in_flight is None:
            return
        path, state = self._in_flight
        self._in_flight = None
        if self.fail_async:
            raise OSError(f"background save of {path} failed")
        save_checkpoint(path, state)

    def save_weights(self, path: str) -> None:
        torch.save(self.get_weights(), path)
        self.weights_saved.append(path)

    def load_weights(self, path: str) -> None:
        self.set_weights(torch.load(path, weights_only=True))

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self._net.state_dict().items()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._net.load_state_dict(weights)

    def nonfinite_weights(self) -> list[str]:
        return [k for k, t in self._net.state_dict().items() if not torch.isfinite(t).all()]

    def weights_are(self, value: float) -> bool:
        return all(bool((t == value).all()) for t in self.get_weights().values())

    def fill(self, value: float) -> None:
        with torch.no_grad():
            for p in self._net.parameters():
                p.fill_(value)


def attach(cb: Callback, model: FakeModel | None = None, **params: Any) -> FakeModel:
    """Attach `cb` to `model` (a new FakeModel by default) with the run parameters."""
    model = model or FakeModel()
    cb.set_model(model)
    cb.set_params({"epochs": 3, "steps": 4, "verbose": 1, "batch_size": 8, "resumed": None,
                   **params})
    return model


def run_epochs(cb: Callback, model: FakeModel, val_losses: list[float],
               each_epoch: Callable[[int], None] | None = None) -> list[int]:
    """Drive `cb` through epochs with the given val_loss; return the epochs run."""
    model.stop_training = False
    cb.on_train_begin({})
    done = []
    for epoch, v in enumerate(val_losses):
        cb.on_epoch_begin(epoch, {})
        if each_epoch:
            each_epoch(epoch)
        cb.on_epoch_end(epoch, {"loss": 1.0, "val_loss": v})
        done.append(epoch)
        if model.stop_training:
            break
    cb.on_train_end({})
    return done


def run_batches(cb: Callback, model: FakeModel, epochs: int, steps: int,
                logs: Callable[[int, int], dict[str, float]]) -> None:
    """Drive `cb` through `epochs` x `steps` batches; `logs(epoch, batch)` gives each batch's
    logs (the epoch logs are the last batch's), one optimizer step per batch."""
    cb.on_train_begin({})
    for epoch in range(epochs):
        cb.on_epoch_begin(epoch, {})
        for batch in range(steps):
            cb.on_train_batch_begin(batch, {})
            model.global_step += 1
            cb.on_train_batch_end(batch, logs(epoch, batch))
        cb.on_epoch_end(epoch, logs(epoch, steps - 1))
    cb.on_train_end({})
