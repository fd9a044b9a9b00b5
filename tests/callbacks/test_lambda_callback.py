"""LambdaCallback: functions as hooks, dispatched only where given."""

from __future__ import annotations

import pytest

from fitdp.callbacks import CallbackList, LambdaCallback


def test_lambda_callback_dispatch():
    got = []
    cb = LambdaCallback(on_epoch_end=lambda e, logs: got.append(("end", e, logs["loss"])),
                        on_train_begin=lambda logs: got.append("begin"),
                        on_test_end=lambda logs: got.append("test"))
    cbs = CallbackList([cb])
    assert cbs._hooks["on_train_batch_end"] == [] and len(cbs._hooks["on_test_end"]) == 1
    assert not cbs.needs_batch_logs
    cbs.call("on_train_begin", {})
    cbs.call("on_epoch_end", 2, {"loss": 0.5})
    cbs.call("on_test_end", {})
    assert got == ["begin", ("end", 2, 0.5), "test"]


def test_lambda_callback_batch_hooks_and_keras_aliases():
    """Keras 3 (lambda_callback_test, test_lambda_callback_with_batches): batch functions run
    for each batch; `on_batch_end` is the Keras alias of `on_train_batch_end`."""
    batches = []
    cb = LambdaCallback(on_batch_end=lambda b, logs: batches.append(b))
    cbs = CallbackList([cb])
    for b in range(3):
        cbs.call("on_train_batch_end", b, {"loss": 1.0})
    assert batches == [0, 1, 2] and cbs.needs_batch_logs


def test_lambda_callback_errors():
    with pytest.raises(TypeError, match=r"LambdaCallback\(on_epoch_ends=...\): got an unknown "
                                        r"keyword; expected hook names"):
        LambdaCallback(on_epoch_ends=print)
    with pytest.raises(TypeError, match=r"on_train_end=...\): got 3"):
        LambdaCallback(on_train_end=3)
