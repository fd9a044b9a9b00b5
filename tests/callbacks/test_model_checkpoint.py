"""ModelCheckpoint at epoch ends: names, best-only, thresholds, weights only, refusals."""

from __future__ import annotations

import os

import pytest
import torch
from callback_helpers import attach, run_epochs

from fitdp.callbacks import ModelCheckpoint


def files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if not f.startswith("."))


def test_model_checkpoint_formats_epoch_and_log_keys(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "ckpt-{epoch:02d}-{val_loss:.3f}.ckpt"))
    model = attach(ckpt)
    run_epochs(ckpt, model, [0.5, 0.25])
    assert files(tmp_path) == ["ckpt-01-0.500.ckpt", "ckpt-02-0.250.ckpt"]
    assert ckpt.latest_checkpoint() == str(tmp_path / "ckpt-02-0.250.ckpt")
    assert ckpt.best == 0.25
    bad = ModelCheckpoint(str(tmp_path / "{epoch}-{val_acc}.ckpt"))
    attach(bad, model)
    with pytest.raises(KeyError, match=r"val_acc.*Available keys: epoch, loss, step, val_loss"):
        bad.on_epoch_end(0, {"loss": 1.0, "val_loss": 1.0})
    spec = ModelCheckpoint(str(tmp_path / "{loss:d}.ckpt"))
    attach(spec, model)
    with pytest.raises(ValueError, match=r"filepath=...\).*format specs.*Fix: epoch, step"):
        spec.on_epoch_end(0, {"loss": 1.0})


def test_model_checkpoint_keep_removes_oldest_after_the_new_one(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), keep=2)
    model = attach(ckpt)
    run_epochs(ckpt, model, [4.0, 3.0, 2.0, 1.0])
    assert files(tmp_path) == ["e3.ckpt", "e4.ckpt"]
    assert model.saved == [str(tmp_path / f"e{i}.ckpt") for i in range(1, 5)]


def test_model_checkpoint_save_best_only_and_mode_auto(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), save_best_only=True)
    model = attach(ckpt)
    run_epochs(ckpt, model, [1.0, 2.0, 0.5, 0.5])
    assert files(tmp_path) == ["e1.ckpt", "e3.ckpt"] and ckpt.best == 0.5
    assert ModelCheckpoint("x", monitor="val_multiclass_accuracy").mode == "max"
    assert ModelCheckpoint("x", monitor="val_f1_score").mode == "max"
    assert ModelCheckpoint("x", monitor="val_loss").mode == "min"
    assert ModelCheckpoint("x", monitor="val_acc", mode="min").mode == "min"


def test_model_checkpoint_argument_errors():
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(mode=...\): got 'best' \(str\); "
                                         r"expected one of 'auto', 'min', 'max'"):
        ModelCheckpoint("x", mode="best")
    with pytest.raises(TypeError, match=r"monitor=...\): got None"):
        ModelCheckpoint("x", monitor=None)
    with pytest.raises(ValueError, match=r"keep=...\): got 0; expected an int >= 1"):
        ModelCheckpoint("x", keep=0)
    with pytest.raises(TypeError, match=r"keep=...\): got 1.5"):
        ModelCheckpoint("x", keep=1.5)
    with pytest.raises(ValueError, match=r"save_freq=...\): got 'batch'.*'epoch'"):
        ModelCheckpoint("x", save_freq="batch")
    with pytest.raises(ValueError, match="positional"):
        ModelCheckpoint("ckpt-{}.ckpt")
    with pytest.raises(ValueError, match="format string"):
        ModelCheckpoint("ckpt-{epoch.ckpt")
    with pytest.raises(TypeError, match=r"filepath=...\): got ''"):
        ModelCheckpoint("")
    with pytest.raises(ValueError, match=r"initial_value_threshold=...\): got nan"):
        ModelCheckpoint("x", initial_value_threshold=float("nan"))
    with pytest.raises(ValueError, match=r"async_save=...\).*save_weights_only"):
        ModelCheckpoint("x", save_weights_only=True, async_save=True)


def test_missing_monitor_with_save_best_only_warns_and_saves(tmp_path):
    """Keras 3 (model_checkpoint_test, case 5): `monitor="unknown"` with save_best_only warns
    with a UserWarning and still writes the file; `best` stays unset."""
    ckpt = ModelCheckpoint(str(tmp_path / "best.ckpt"), save_best_only=True)
    model = attach(ckpt)
    with pytest.warns(UserWarning, match=r"'val_loss'.*Available keys: loss"):
        ckpt.on_epoch_end(0, {"loss": 1.0})
    assert files(tmp_path) == ["best.ckpt"] and model.saved and ckpt.best is None


@pytest.mark.parametrize(("mode", "monitor", "threshold", "saved"), [
    ("max", "val_acc", -0.01, True),     # case 11: any accuracy beats -0.01
    ("auto", "val_loss", None, True),     # case 12: no threshold, the first value saves
    ("min", "val_loss", 0.0, False),      # case 13: no loss beats 0
    ("auto", "val_loss", 0.0, False),     # case 14: the same in auto mode
    ("auto", "val_auc", 1.0, False),      # case 15: no AUC beats 1
])
def test_initial_value_threshold_like_keras(tmp_path, mode, monitor, threshold, saved):
    """Keras 3 (model_checkpoint_test, cases 11-15): with save_best_only the monitored value
    must beat `initial_value_threshold` before anything is saved."""
    ckpt = ModelCheckpoint(str(tmp_path / "c.ckpt"), monitor=monitor, mode=mode,
                           save_best_only=True, initial_value_threshold=threshold)
    attach(ckpt)
    ckpt.on_train_begin({})
    ckpt.on_epoch_end(0, {"loss": 0.5, monitor: 0.3})
    assert os.path.exists(tmp_path / "c.ckpt") is saved
    assert ckpt.best == (0.3 if saved else threshold)


def test_best_carries_over_to_the_next_fit_like_keras(tmp_path):
    """Keras's ModelCheckpoint sets `best` once (in its constructor): a second fit with the
    same callback only saves when it beats the first fit's best."""
    ckpt = ModelCheckpoint(str(tmp_path / "best.ckpt"), save_best_only=True)
    model = attach(ckpt)
    run_epochs(ckpt, model, [0.5])
    run_epochs(ckpt, model, [0.7, 0.4])
    assert len(model.saved) == 2 and ckpt.best == 0.4


def test_save_weights_only_uses_save_weights(tmp_path):
    """Keras 3: `save_weights_only=True` saves with `model.save_weights(filepath)`."""
    ckpt = ModelCheckpoint(str(tmp_path / "w{epoch}.pt"), save_weights_only=True, keep=1)
    model = attach(ckpt)
    model.fill(0.5)
    run_epochs(ckpt, model, [1.0, 0.9])
    assert model.saved == [] and model.weights_saved == [str(tmp_path / f"w{i}.pt")
                                                         for i in (1, 2)]
    assert files(tmp_path) == ["w2.pt"]
    weights = torch.load(tmp_path / "w2.pt", weights_only=True)
    assert all(bool((t == 0.5).all()) for t in weights.values())
    assert ckpt.latest_checkpoint() is None  # a weights file cannot resume a run


def test_model_checkpoint_refuses_nan(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"))
    model = attach(ckpt)
    with pytest.warns(UserWarning, match="loss is nan"):
        ckpt.on_epoch_end(0, {"loss": float("nan"), "val_loss": 1.0})
    with pytest.warns(UserWarning, match="val_loss is inf"):
        ckpt.on_epoch_end(1, {"loss": 1.0, "val_loss": float("inf")})
    model.fill(float("nan"))
    with pytest.warns(UserWarning, match="non-finite values in weight"):
        ckpt.on_epoch_end(2, {"loss": 1.0, "val_loss": 1.0})
    assert not os.listdir(tmp_path) and ckpt.best is None


def test_model_checkpoint_latest_on_disk_picks_newest_mtime(tmp_path):
    for i, name in enumerate(["c-10.ckpt", "c-02.ckpt", "other.ckpt"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    assert ModelCheckpoint(str(tmp_path / "c-{epoch:02d}.ckpt")).latest_checkpoint() == \
        str(tmp_path / "c-02.ckpt")
    assert ModelCheckpoint(str(tmp_path / "none-{epoch}.ckpt")).latest_checkpoint() is None


def test_model_checkpoint_writes_only_on_main_process(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"))
    model = attach(ckpt)
    model.is_main_process = False
    run_epochs(ckpt, model, [1.0])
    assert not os.listdir(tmp_path)
