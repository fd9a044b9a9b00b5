"""LearningRateScheduler and ReduceLROnPlateau: rates, cooldown, the logged `lr`, and the
refusal to run on top of a compiled `lr_scheduler`."""

from __future__ import annotations

import pytest
import torch
from callback_helpers import FakeModel, attach

from fitdp.callbacks import LearningRateScheduler, ReduceLROnPlateau


def test_reduce_lr_on_plateau_reduction_and_cooldown():
    plateau = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=2)
    model = attach(plateau)
    plateau.on_train_begin({})
    lrs = []
    for epoch in range(6):
        plateau.on_epoch_end(epoch, {"val_loss": 1.0})
        lrs.append(model.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025, 0.0125])


def test_reduce_lr_on_plateau_min_lr_state_and_errors():
    plateau = ReduceLROnPlateau(factor=0.1, patience=0, min_lr=0.005)
    model = attach(plateau)
    plateau.on_train_begin({})
    for epoch in range(4):
        plateau.on_epoch_end(epoch, {"val_loss": 1.0})
    assert model.optimizer.param_groups[0]["lr"] == 0.005
    again = ReduceLROnPlateau(patience=2)
    attach(again)
    again.on_train_begin({})  # the model's order on resume: begin, then the saved state
    again.load_state_dict({"best": 0.3, "wait": 1, "cooldown_counter": 0})
    assert again.best == 0.3 and again.wait == 1
    again.on_train_begin({})  # a new fit starts over (Keras)
    assert again.best is None and again.wait == 0
    with pytest.raises(ValueError, match=r"factor=...\): got 1.5; expected a finite number "
                                         r">= 0 and < 1\. Fix: factor >= 1 would not reduce"):
        ReduceLROnPlateau(factor=1.5)
    with pytest.raises(ValueError, match=r"cooldown=...\): got -1"):
        ReduceLROnPlateau(cooldown=-1)


def test_lr_callbacks_leave_the_logged_lr_alone():
    """Regression: ReduceLROnPlateau and LearningRateScheduler overwrote the epoch logs' `lr`
    with the rate after their change; the model's `lr` is the rate the epoch trained with."""
    plateau = ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0)
    sched = LearningRateScheduler(lambda epoch, lr: lr)
    model = attach(plateau)
    attach(sched, model)
    for cb in (plateau, sched):
        cb.on_train_begin({})
    for epoch in range(3):
        sched.on_epoch_begin(epoch, {})
        logs = {"loss": 1.0, "lr": model.optimizer.param_groups[0]["lr"]}
        before = dict(logs)
        plateau.on_epoch_end(epoch, logs)
        sched.on_epoch_end(epoch, logs)
        assert logs == before
    assert model.optimizer.param_groups[0]["lr"] == 0.025  # reduced after epochs 1 and 2


@pytest.mark.parametrize("make", [lambda: ReduceLROnPlateau(),
                                  lambda: LearningRateScheduler(lambda epoch, lr: lr)])
def test_lr_callback_on_a_compiled_scheduler_is_an_error(make):
    """Two things setting the rate (a callback and compile(lr_scheduler=...)) fight; say so
    at the start of fit instead."""
    model = FakeModel()
    model.lr_scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, 1)
    cb = make()
    attach(cb, model)
    with pytest.raises(ValueError, match=rf"callbacks \({type(cb).__name__}\): got a model "
                                         r"compiled with lr_scheduler=StepLR; .*Fix: drop"):
        cb.on_train_begin({})


def test_learning_rate_scheduler_sets_every_group():
    sched = LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch > 0 else lr)
    model = attach(sched, FakeModel(lrs=(0.1, 0.01)))
    sched.on_train_begin({})
    for epoch in range(3):
        sched.on_epoch_begin(epoch, {})
    assert [g["lr"] for g in model.optimizer.param_groups] == pytest.approx([0.025, 0.0025])


def test_learning_rate_scheduler_old_api_and_errors():
    """Keras's older `schedule(epoch)` (without the current rate) still works."""
    old_api = LearningRateScheduler(lambda epoch: 0.2 / (epoch + 1))
    model = attach(old_api)
    old_api.on_epoch_begin(1, {})
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    bad = LearningRateScheduler(lambda epoch, lr: "fast")
    attach(bad)
    with pytest.raises(ValueError, match=r"got 'fast' returned for epoch 0 \(lr 0.1\)"):
        bad.on_epoch_begin(0, {})
    with pytest.raises(TypeError, match=r"schedule=...\): got 0.1"):
        LearningRateScheduler(0.1)
    uncompiled = LearningRateScheduler(lambda epoch, lr: lr)
    attach(uncompiled).optimizer = None
    with pytest.raises(RuntimeError, match="compile"):
        uncompiled.on_epoch_begin(0, {})
