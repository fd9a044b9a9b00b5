"""The order fit/evaluate/predict call callback hooks in, pinned with a mock (Poutyne style)."""

from __future__ import annotations

from unittest.mock import MagicMock, call

import torch
from torch import nn

import fitdp
from fitdp.callbacks import Callback


def model_and_data():
    torch.manual_seed(0)
    model = fitdp.Model(nn.Linear(3, 2))
    model.compile(optimizer="sgd", loss="cross_entropy")
    return model, torch.randn(10, 3), torch.randint(0, 2, (10,))


def hook_names(mock: MagicMock) -> list[str]:
    return [c[0] for c in mock.method_calls if c[0].startswith("on_")]


def test_fit_order_with_validation():
    model, x, y = model_and_data()
    cb = MagicMock(spec=Callback)
    model.fit(x, y, batch_size=4, epochs=2, validation_data=(x[:6], y[:6]), callbacks=[cb],
              verbose=0)
    # on_before_optimizer_step inside the batch, before its end (Lightning's order)
    epoch = (["on_epoch_begin"] + ["on_train_batch_begin", "on_before_optimizer_step",
                                   "on_train_batch_end"] * 3
             + ["on_test_begin"] + ["on_test_batch_begin", "on_test_batch_end"] * 2
             + ["on_test_end", "on_epoch_end"])
    assert hook_names(cb) == ["on_train_begin", *epoch, *epoch, "on_train_end"]
    assert cb.on_epoch_begin.call_args_list == [call(0, {}), call(1, {})]
    assert [c.args[0] for c in cb.on_train_batch_end.call_args_list] == [0, 1, 2] * 2
    logs = cb.on_epoch_end.call_args_list[-1].args[1]
    assert set(logs) == {"loss", "val_loss", "lr"}
    assert all(isinstance(v, float) for v in logs.values())
    cb.set_model.assert_called_with(model)


def test_evaluate_and_predict_order():
    model, x, y = model_and_data()
    cb = MagicMock(spec=Callback)
    model.evaluate(x, y, batch_size=5, callbacks=[cb], verbose=0)
    assert hook_names(cb) == ["on_test_begin", "on_test_batch_begin", "on_test_batch_end",
                              "on_test_batch_begin", "on_test_batch_end", "on_test_end"]
    cb.reset_mock()
    model.predict(x, batch_size=10, callbacks=[cb])
    assert hook_names(cb) == ["on_predict_begin", "on_predict_batch_begin",
                              "on_predict_batch_end", "on_predict_end"]


def test_batch_logs_are_never_empty_and_exact_every_batch_on_cpu():
    """Keras passes the running loss to every on_train_batch_end; on the CPU reading it costs
    no device sync, so fitdp's batch logs are exact at every batch there (issue 11.5)."""
    model, x, y = model_and_data()
    seen = []
    cb = fitdp.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(dict(logs)))
    model.fit(x, y, batch_size=2, callbacks=[cb], verbose=0, log_every=2, shuffle=False)
    assert len(seen) == 5 and all(set(s) == {"loss"} for s in seen)
    assert len({s["loss"] for s in seen}) == 5  # a fresh value at every batch
