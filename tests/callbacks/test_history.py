"""History: records the epoch logs, starts over each fit, continues a resumed one, plots."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from callback_helpers import FakeModel

from fitdp.callbacks import (
    CallbackList,
    History,
    LambdaCallback,
    LearningRateScheduler,
    ReduceLROnPlateau,
)

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def test_history_records_and_restarts_each_fit():
    h = History()
    h.on_train_begin()
    h.on_epoch_end(0, {"loss": 2.0, "val_loss": 3.0})
    h.on_epoch_end(1, {"loss": 1.0, "val_loss": 2.0})
    assert h.history == {"loss": [2.0, 1.0], "val_loss": [3.0, 2.0]} and h.epoch == [0, 1]
    state = h.state_dict()
    h.on_train_begin()
    assert h.history == {} and h.epoch == []
    # A resumed fit: on_train_begin first, then the saved state (no "restored" flag).
    h.load_state_dict(state)
    h.on_epoch_end(2, {"loss": 0.5, "val_loss": 1.5})
    assert h.epoch == [0, 1, 2] and h.history["loss"] == [2.0, 1.0, 0.5]


def test_history_keeps_the_models_lr_not_the_reduced_one():
    """Regression: LR callbacks wrote the rate after their change into the epoch logs, so
    History said epoch 0 trained at the reduced rate. Now the model's `lr` (the rate the
    epoch trained with) is what every callback sees and History records."""
    model = FakeModel()
    cbs = CallbackList([ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0),
                        LearningRateScheduler(lambda epoch, lr: lr)],
                       model=model, add_history=True)
    cbs.call("on_train_begin", {})
    for epoch in range(3):
        cbs.call("on_epoch_begin", epoch, {})
        # The model puts the rate the epoch trained with before on_epoch_end.
        trained_with = model.optimizer.param_groups[0]["lr"]
        logs = {"loss": 1.0, "lr": trained_with}
        cbs.call("on_epoch_end", epoch, logs)
        assert logs["lr"] == trained_with  # untouched by the callbacks
    cbs.call("on_train_end", {})
    # Epoch 0 sets the best loss; epochs 1 and 2 do not improve and reduce at their end.
    assert cbs.history.history["lr"] == [0.1, 0.1, 0.05]
    assert model.optimizer.param_groups[0]["lr"] == 0.025


def test_history_records_keys_a_later_callback_adds():
    """Keras's History runs last and so sees keys other callbacks add to the epoch logs;
    fitdp's runs first (checkpoints hold the epoch) and picks them up afterwards."""
    def add(epoch, logs):
        logs["custom"] = float(epoch)

    cbs = CallbackList([LambdaCallback(on_epoch_end=add)], add_history=True)
    cbs.call("on_train_begin", {})
    for epoch in range(2):
        cbs.call("on_epoch_begin", epoch, {})
        cbs.call("on_epoch_end", epoch, {"loss": 1.0})
    cbs.call("on_train_end", {})
    assert cbs.history.history == {"loss": [1.0, 1.0], "custom": [0.0, 1.0]}


def _history() -> History:
    h = History()
    h.on_train_begin()
    for e in range(3):
        h.on_epoch_end(e, {"loss": 1.0 / (e + 1), "multiclass_accuracy": 0.5 + e / 10,
                           "val_loss": 1.5 / (e + 1), "val_multiclass_accuracy": 0.4 + e / 10})
    return h


@pytest.mark.skipif(not HAS_MPL, reason="needs matplotlib")
def test_history_plot(tmp_path):
    h, path = _history(), tmp_path / "history.png"
    fig = h.plot(str(path))
    assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x89PNG"
    assert [ax.get_title() for ax in fig.axes] == ["loss", "multiclass_accuracy"]
    assert len(fig.axes[0].lines) == 2  # train and validation
    assert len(h.plot(keys=["loss"]).axes) == 1
    with pytest.raises(ValueError, match="nope"):
        h.plot(keys=["nope"])


def test_history_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"matplotlib.*pip install matplotlib"):
        _history().plot()
