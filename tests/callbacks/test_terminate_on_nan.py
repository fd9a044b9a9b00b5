"""TerminateOnNaN: a graceful stop by default, a RuntimeError with `raise_error=True`."""

from __future__ import annotations

import logging

import pytest
from callback_helpers import attach

from fitdp.callbacks import CallbackList, LambdaCallback, TerminateOnNaN


def test_terminate_on_nan_stops_gracefully(caplog):
    stop = TerminateOnNaN()
    model = attach(stop)
    assert stop.sync_every_batch and stop.needs_batch_logs and not stop.raise_error
    stop.on_train_batch_end(0, {"loss": 1.0})
    assert not model.stop_training
    with caplog.at_level(logging.WARNING, logger="fitdp"):
        stop.on_train_batch_end(1, {"loss": float("nan")})
    assert model.stop_training and "Batch 1: invalid loss nan" in caplog.text


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_terminate_on_nan_raise_error_like_keras(loss):
    """Keras 3 (terminate_on_nan_test, test_terminate_on_nan_raise_error_raises_error and
    test_raise_error_terminate_does_not_trigger_on_train_end): with raise_error=True a NaN or
    Inf loss raises RuntimeError("NaN or Inf loss encountered ...") at that batch, and the
    callbacks listed after it do not see the batch (nor on_train_end, which fit skips)."""
    seen = []
    stop = TerminateOnNaN(raise_error=True)
    model = attach(stop)
    cbs = CallbackList([stop, LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))],
                       model=model)
    cbs.call("on_train_batch_end", 0, {"loss": 1.0})
    with pytest.raises(RuntimeError, match=r"NaN or Inf loss encountered at batch 3"):
        cbs.call("on_train_batch_end", 3, {"loss": loss})
    assert seen == [0] and not model.stop_training


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_terminate_on_nan_message_carries_keras_wording(loss):
    """Regression (issue 17 item 10): raise_error's message was fitdp's own ("TerminateOnNaN:
    NaN or Inf loss (nan) at batch 2"), so code matching Keras's text missed it. Keras 3,
    keras/src/callbacks/terminate_on_nan.py (TerminateOnNaN.on_batch_end) raises
    RuntimeError(f"NaN or Inf loss encountered at batch {batch}. Loss value: {loss}.
    Terminating training immediately."): fitdp's message starts with exactly that text."""
    stop = TerminateOnNaN(raise_error=True)
    attach(stop)
    with pytest.raises(RuntimeError) as info:
        stop.on_train_batch_end(2, {"loss": loss})
    keras_text = (f"NaN or Inf loss encountered at batch 2. Loss value: {loss}. "
                  f"Terminating training immediately")
    assert str(info.value).startswith(keras_text), str(info.value)


def test_terminate_on_nan_ignores_logs_without_loss():
    stop = TerminateOnNaN(raise_error=True)
    model = attach(stop)
    stop.on_train_batch_end(0, {"acc": float("nan")})
    stop.on_train_batch_end(1, None)
    assert not model.stop_training
