"""TensorBoard: epoch scalars, batch scalars every N batches, weight histograms every N epochs."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from callback_helpers import attach, run_batches

from fitdp.callbacks import CallbackList, TensorBoard

needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="needs the tensorboard package")


def read_events(folder) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Scalar and histogram tags in `folder`'s event files, each with its steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [e.step for e in acc.Scalars(t)] for t in tags["scalars"]}
    histograms = {t: [e.step for e in acc.Histograms(t)] for t in tags["histograms"]}
    return scalars, histograms


def _fit(tb: TensorBoard, epochs: int = 2, steps: int = 5) -> None:
    model = attach(tb)
    run_batches(tb, model, epochs, steps,
                logs=lambda e, b: {"loss": 1.0 / (b + 1), "val_loss": 2.0} if b == steps - 1
                else {"loss": 1.0 / (b + 1)})


@needs_tensorboard
def test_tensorboard_writes_epoch_scalars_only_by_default(tmp_path):
    tb = TensorBoard(tmp_path / "tb")
    _fit(tb)
    scalars, histograms = read_events(tmp_path / "tb")
    assert scalars == {"train/loss": [0, 1], "val/loss": [0, 1]} and histograms == {}
    assert not tb.needs_batch_logs and tb.state_dict() == {}


@needs_tensorboard
@pytest.mark.parametrize(("update_freq", "steps"), [("batch", list(range(1, 11))),
                                                    (1, list(range(1, 11))), (3, [3, 6, 9])])
def test_tensorboard_batch_scalars_every_n_batches(tmp_path, update_freq, steps):
    """Keras 3 (tensorboard_test, test_TensorBoard_batch_metrics and TensorBoard's
    `update_freq`): "batch" is 1; with N the batch logs are written every N batches, the x
    axis counting batches across epochs from the start of the fit."""
    tb = TensorBoard(tmp_path / "tb", update_freq=update_freq)
    _fit(tb)
    scalars, _ = read_events(tmp_path / "tb")
    assert scalars["train_batch/loss"] == steps
    assert scalars["train/loss"] == [0, 1] and tb.needs_batch_logs


@needs_tensorboard
def test_tensorboard_histograms_every_n_epochs(tmp_path):
    """Keras 3 (TensorBoard `histogram_freq`): weight histograms at the epochs where
    `epoch % histogram_freq == 0`, so the first epoch always has them."""
    tb = TensorBoard(tmp_path / "tb", histogram_freq=2)
    _fit(tb, epochs=3, steps=2)
    _, histograms = read_events(tmp_path / "tb")
    assert histograms == {"weights/weight": [0, 2], "weights/bias": [0, 2]}


@needs_tensorboard
def test_tensorboard_batch_count_survives_resume(tmp_path):
    tb = TensorBoard(tmp_path / "tb", update_freq=2)
    _fit(tb, epochs=1, steps=3)
    again = TensorBoard(tmp_path / "tb", update_freq=2)
    cbs = CallbackList([again], model=attach(again))
    cbs.call("on_train_begin", {})
    cbs.load_state_dict({f"TensorBoard[{tmp_path / 'tb'}]": tb.state_dict()})
    cbs.call("on_train_batch_end", 0, {"loss": 0.5})
    cbs.call("on_train_end", {})
    scalars, _ = read_events(tmp_path / "tb")
    assert scalars["train_batch/loss"] == [2, 4]


@needs_tensorboard
def test_tensorboard_writes_nothing_off_main_process(tmp_path):
    tb = TensorBoard(tmp_path / "tb", update_freq=1, histogram_freq=1)
    attach(tb).is_main_process = False
    tb.on_train_begin({})
    tb.on_train_batch_end(0, {"loss": 1.0})
    tb.on_epoch_end(0, {"loss": 1.0})
    tb.on_train_end({})
    assert not (tmp_path / "tb").exists()


@needs_tensorboard
def test_tensorboard_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"update_freq=...\): got 'step'.*'epoch', 'batch'"):
        TensorBoard(tmp_path, update_freq="step")
    with pytest.raises(ValueError, match=r"update_freq=...\): got 0"):
        TensorBoard(tmp_path, update_freq=0)
    with pytest.raises(ValueError, match=r"histogram_freq=...\): got -1"):
        TensorBoard(tmp_path, histogram_freq=-1)
    with pytest.raises(TypeError, match=r"log_dir=...\): got ''"):
        TensorBoard("")


def test_tensorboard_missing_package_is_a_clear_import_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"`tensorboard` package.*pip install tensorboard"):
        TensorBoard(tmp_path)
