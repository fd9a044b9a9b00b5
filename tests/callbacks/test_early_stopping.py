"""EarlyStopping: Keras 3 patience, baseline, warm-up, best weights, and resume."""

from __future__ import annotations

import pytest
from callback_helpers import attach, run_epochs

from fitdp.callbacks import EarlyStopping


def test_early_stopping_patience_and_restore_best_weights():
    stop = EarlyStopping(patience=2, restore_best_weights=True)
    model = attach(stop)
    done = run_epochs(stop, model, [1.0, 0.5, 0.6, 0.7, 0.8, 0.9], each_epoch=model.fill)
    assert done == [0, 1, 2, 3] and stop.stopped_epoch == 3 and stop.best_epoch == 1
    assert model.weights_are(1.0)  # epoch 1's weights


def test_early_stopping_restores_at_train_end_without_stopping_like_keras3():
    """Keras 3 restores the best weights at the end of training even when it did not stop
    early (Keras 2 restored only after an early stop)."""
    stop = EarlyStopping(patience=5, restore_best_weights=True)
    model = attach(stop)
    done = run_epochs(stop, model, [1.0, 0.5, 0.6], each_epoch=model.fill)
    assert done == [0, 1, 2] and stop.stopped_epoch == 0
    assert model.weights_are(1.0)


def test_early_stopping_min_delta_baseline_start_and_mode():
    stop = EarlyStopping(patience=1, min_delta=0.1)
    assert run_epochs(stop, attach(stop), [1.0, 0.95, 0.9]) == [0, 1]
    stop = EarlyStopping(patience=2, baseline=0.1)  # improvements above it keep the wait
    assert run_epochs(stop, attach(stop), [1.0, 0.9, 0.95, 0.96]) == [0, 1, 2]
    stop = EarlyStopping(patience=2)
    assert run_epochs(stop, attach(stop), [1.0, 0.9, 0.95, 0.96]) == [0, 1, 2, 3]
    stop = EarlyStopping(patience=0, start_from_epoch=2)
    assert run_epochs(stop, attach(stop), [1.0, 2.0, 3.0, 4.0]) == [0, 1, 2, 3]
    stop = EarlyStopping(monitor="val_accuracy", patience=1)
    model = attach(stop)
    stop.on_train_begin()
    for epoch, acc in enumerate([0.5, 0.6, 0.55]):
        stop.on_epoch_end(epoch, {"val_accuracy": acc})
    assert stop.mode == "max" and stop.best == 0.6 and model.stop_training


def test_early_stopping_errors_and_missing_key_warning():
    with pytest.raises(ValueError, match=r"EarlyStopping\(patience=...\): got -1"):
        EarlyStopping(patience=-1)
    with pytest.raises(TypeError, match=r"patience=...\): got 1.5"):
        EarlyStopping(patience=1.5)
    with pytest.raises(ValueError, match=r"min_delta=...\): got -0.1"):
        EarlyStopping(min_delta=-0.1)
    with pytest.warns(UserWarning, match="Available keys: loss"):
        EarlyStopping().on_epoch_end(0, {"loss": 1.0})


def test_early_stopping_instance_reused_across_fits_starts_over():
    stop = EarlyStopping(patience=1)
    model = attach(stop)
    assert run_epochs(stop, model, [1.0, 2.0]) == [0, 1]
    assert run_epochs(stop, model, [5.0, 4.0, 3.0]) == [0, 1, 2]  # best 1.0 forgotten


def test_early_stopping_state_survives_resume():
    """The model calls on_train_begin first and load_state_dict after: the loaded state is
    what the resumed run continues with (no "just restored" flag)."""
    stop = EarlyStopping(patience=3)
    attach(stop)
    stop.on_train_begin()
    stop.on_epoch_end(0, {"val_loss": 1.0})
    stop.on_epoch_end(1, {"val_loss": 2.0})
    again = EarlyStopping(patience=3)
    model = attach(again)
    again.on_train_begin()
    again.load_state_dict(stop.state_dict())
    again.on_epoch_end(2, {"val_loss": 2.0})
    again.on_epoch_end(3, {"val_loss": 2.0})
    assert again.best == 1.0 and model.stop_training and again.stopped_epoch == 3
