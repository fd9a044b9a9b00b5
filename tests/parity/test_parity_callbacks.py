"""Callbacks on a real `fitdp.Model` against Keras 3: ModelCheckpoint at a step frequency
(names, best-only, `initial_value_threshold`), the learning rate in the logs with
ReduceLROnPlateau, batch logs, EarlyStopping, TerminateOnNaN, BackupAndRestore's double
checkpoint and TensorBoard's frequencies. `*_keras` twins run Keras 3 on the same weights."""

from __future__ import annotations

import os

import pytest
import torch
from twins import cross_entropy, data, fitdp_model, keras_model, linear, np_, same_weights

import fitdp
import fitdp.callbacks
from fitdp.callbacks import (
    BackupAndRestore,
    Callback,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TensorBoard,
    TerminateOnNaN,
)

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def batch_log_recorder(callbacks=fitdp.callbacks) -> tuple[list[dict[str, float]], object]:
    """A callback (fitdp's, or Keras's with `callbacks=keras.callbacks`) keeping a copy of
    every training batch's logs."""
    seen: list[dict[str, float]] = []
    return seen, callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(dict(logs)))


# Batch logs are exact at every batch where that costs no device sync: the CPU. The tests of
# exact batch logs run there whatever the machine has.
CPU = ["cpu"]


def stems(folder) -> list[str]:
    return sorted(os.path.splitext(f)[0] for f in os.listdir(folder))


# -- ModelCheckpoint --------------------------------------------------------------------------

def test_step_checkpoints_are_named_by_the_logs_of_the_step_they_save(tmp_path):
    """Keras: with `save_freq=N` the callback saves after every N batches it has seen
    (counted across epochs, not the model's optimizer steps), formatting the name with the
    epoch, the 1-based batch and that batch's logs (the running loss of the epoch)."""
    x, y, _ = data(16)
    model = fitdp_model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # global_step 4 before the run
    logs, rec = batch_log_recorder()
    ckpt = ModelCheckpoint(str(tmp_path / "c-{epoch}-{batch}-{loss:.3f}.ckpt"), save_freq=3,
                           monitor="loss")
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, callbacks=[ckpt, rec], verbose=0,
              devices=CPU)
    # The 3rd and 6th batches of this fit: epoch 1 batch 3, epoch 2 batch 2.
    assert stems(tmp_path) == [f"c-1-3-{logs[2]['loss']:.3f}", f"c-2-2-{logs[5]['loss']:.3f}"]


def test_step_checkpoints_best_only_judge_that_steps_loss(tmp_path):
    """Keras: `save_best_only` at a step frequency compares the monitored value of the
    batch logs at that step with the best so far."""
    x, y, _ = data(16)
    logs, rec = batch_log_recorder()
    ckpt = ModelCheckpoint(str(tmp_path / "c-{epoch}-{batch}.ckpt"), save_freq=1,
                           monitor="loss", save_best_only=True)
    fitdp_model(lr=3.0).fit(x, y, batch_size=4, epochs=2, shuffle=False,
                            callbacks=[ckpt, rec], verbose=0, devices=CPU)
    best, expected = float("inf"), []
    for i, entry in enumerate(logs):
        if entry["loss"] < best:
            best = entry["loss"]
            expected.append(f"c-{i // 4 + 1}-{i % 4 + 1}")
    assert 0 < len(expected) < len(logs)  # some steps did not improve
    assert stems(tmp_path) == sorted(expected)


def test_a_missing_monitored_key_warns_and_saves(tmp_path):
    """Keras 3: best-only with a monitor missing from the logs warns and saves anyway."""
    x, y, _ = data(16)
    ckpt = ModelCheckpoint(str(tmp_path / "c-{epoch}.ckpt"), monitor="val_loss",
                           save_best_only=True)
    with pytest.warns(UserWarning, match="val_loss"):
        fitdp_model().fit(x, y, epochs=2, callbacks=[ckpt], verbose=0)
    assert stems(tmp_path) == ["c-1", "c-2"]


def test_initial_value_threshold_is_the_best_to_beat(tmp_path):
    """Keras: `initial_value_threshold` is the starting best value of `save_best_only`."""
    x, y, _ = data(16)
    losses = fitdp_model().fit(x, y, batch_size=4, epochs=3, shuffle=False,
                               verbose=0).history["loss"]
    threshold = (losses[0] + losses[1]) / 2  # epoch 1 does not beat it; 2 and 3 do
    ckpt = ModelCheckpoint(str(tmp_path / "c-{epoch}.ckpt"), monitor="loss",
                           save_best_only=True, initial_value_threshold=threshold)
    fitdp_model().fit(x, y, batch_size=4, epochs=3, shuffle=False, callbacks=[ckpt],
                      verbose=0)
    assert stems(tmp_path) == ["c-2", "c-3"]


@pytest.mark.parametrize("case", ["every_3", "best_only", "threshold"])
def test_checkpoint_files_keras(keras, tmp_path, case):
    """The same files (up to the extension) as Keras's ModelCheckpoint."""
    x, y, _ = data(16)
    lr = 3.0 if case == "best_only" else 0.1
    kw = {"every_3": {"save_freq": 3}, "best_only": {"save_freq": 1, "save_best_only": True},
          "threshold": {"save_best_only": True, "initial_value_threshold": 1.2}}[case]
    name = "c-{epoch}-{batch}-{loss:.3f}" if case != "threshold" else "c-{epoch}-{loss:.3f}"
    ours = ModelCheckpoint(str(tmp_path / "f" / f"{name}.ckpt"), monitor="loss", **kw)
    theirs = keras.callbacks.ModelCheckpoint(str(tmp_path / "k" / f"{name}.keras"),
                                             monitor="loss", mode="min", **kw)
    # Keras 3.15 sets its comparison at the first epoch end; a step save before it fails.
    getattr(theirs, "_set_monitor_op", lambda: None)()
    fit = {"batch_size": 4, "epochs": 3, "shuffle": False, "verbose": 0}
    fitdp_model(lr=lr).fit(x, y, callbacks=[ours], devices=CPU, **fit)
    keras_model(keras, lr=lr).fit(*np_(x, y), callbacks=[theirs], **fit)
    assert stems(tmp_path / "f") == stems(tmp_path / "k") != []


# -- the learning rate in the logs ------------------------------------------------------------

def test_the_lr_log_is_the_rate_the_epoch_trained_with():
    """Keras's ReduceLROnPlateau logs the rate the epoch trained with (read before it
    reduces it); fitdp's model logs it as `lr` whenever the optimizer has a rate."""
    x, y, _ = data(16)
    plain = fitdp_model().fit(x, y, epochs=2, verbose=0)
    assert plain.history["lr"] == [0.1, 0.1]
    plateau = ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=10.0)
    h = fitdp_model().fit(x, y, batch_size=8, epochs=4, callbacks=[plateau], verbose=0)
    assert h.history["lr"] == pytest.approx([0.1, 0.1, 0.05, 0.025])


def test_reduce_lr_on_plateau_keras(keras):
    """Rates and losses equal Keras's (its key is `learning_rate`)."""
    x, y, _ = data(16)
    kw = {"monitor": "loss", "factor": 0.5, "patience": 1, "min_delta": 10.0}
    fit = {"batch_size": 8, "epochs": 4, "shuffle": False, "verbose": 0}
    ours = fitdp_model().fit(x, y, callbacks=[ReduceLROnPlateau(**kw)], **fit)
    theirs = keras_model(keras).fit(*np_(x, y),
                                    callbacks=[keras.callbacks.ReduceLROnPlateau(**kw)], **fit)
    assert ours.history["lr"] == pytest.approx(theirs.history["learning_rate"])
    assert ours.history["loss"] == pytest.approx(theirs.history["loss"], rel=1e-5)


def test_an_lr_callback_on_a_compiled_scheduler_is_an_error():
    """Keras refuses a rate callback on an optimizer whose rate is a schedule; fitdp says
    so when fit starts, before any step."""
    x, y, _ = data(16)
    model = fitdp_model()
    model.compile("sgd", "cross_entropy", lr=0.1,
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ValueError, match="lr_scheduler"):
        model.fit(x, y, epochs=1, callbacks=[ReduceLROnPlateau(monitor="loss")], verbose=0)
    assert model.global_step == 0


# -- batch logs -------------------------------------------------------------------------------

def test_batch_logs_hold_the_running_loss_and_metrics_of_every_batch():
    """Keras: `on_train_batch_end` gets the epoch's running loss and metrics at every batch.
    On the CPU fitdp's are exact at every batch; the last batch's equal the epoch's."""
    x, y, _ = data(16)
    logs, rec = batch_log_recorder()
    h = fitdp_model(lr=0.0).fit(x, y, batch_size=4, epochs=1, shuffle=False,
                                callbacks=[rec], verbose=0, devices=CPU)
    assert all(set(entry) == {"loss", "accuracy"} for entry in logs) and len(logs) == 4
    per = cross_entropy(linear(), x, y)
    assert [e["loss"] for e in logs] == pytest.approx(
        [float(per[:4 * (i + 1)].mean()) for i in range(4)])
    assert logs[-1]["accuracy"] == pytest.approx(h.history["accuracy"][0])


def test_batch_logs_are_never_empty_when_read_every_log_every_batches():
    """When no callback needs exact batch logs (or reading them costs a device sync), the
    logs are the latest values read, refreshed every `log_every` batches: never empty."""
    class Relaxed(Callback):
        needs_batch_logs = False

        def __init__(self) -> None:
            super().__init__()
            self.logs: list[dict[str, float]] = []

        def on_train_batch_end(self, batch, logs=None):
            self.logs.append(dict(logs))

    x, y, _ = data(16)
    cb = Relaxed()
    fitdp_model().fit(x, y, batch_size=2, epochs=1, log_every=3, shuffle=False,
                      callbacks=[cb], verbose=0)
    assert all(entry and "loss" in entry for entry in cb.logs)
    assert cb.logs[1] == cb.logs[0] and cb.logs[3] == cb.logs[2] != cb.logs[1]  # reads: 0, 2, 5


def test_batch_logs_keras(keras):
    """Every batch's logs equal Keras's."""
    x, y, _ = data(16)
    ours, rec = batch_log_recorder()
    theirs, krec = batch_log_recorder(keras.callbacks)
    fit = {"batch_size": 4, "epochs": 2, "shuffle": False, "verbose": 0}
    fitdp_model().fit(x, y, callbacks=[rec], devices=CPU, **fit)
    keras_model(keras).fit(*np_(x, y), callbacks=[krec], **fit)
    assert [sorted(e) for e in ours] == [sorted(e) for e in theirs]
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5)


# -- EarlyStopping, TerminateOnNaN ------------------------------------------------------------

def test_early_stopping_keras(keras):
    """Epochs run and restored best weights equal Keras's EarlyStopping."""
    x, y, _ = data(16)
    kw = {"monitor": "loss", "patience": 2, "min_delta": 0.03, "restore_best_weights": True}
    fit = {"batch_size": 8, "epochs": 30, "shuffle": False, "verbose": 0}
    model = fitdp_model(lr=0.5)
    ours = model.fit(x, y, callbacks=[EarlyStopping(**kw)], **fit)
    twin = keras_model(keras, lr=0.5)
    theirs = twin.fit(*np_(x, y), callbacks=[keras.callbacks.EarlyStopping(**kw)], **fit)
    assert ours.epoch == theirs.epoch and len(ours.epoch) < 30
    assert same_weights(model, twin, atol=1e-5)


def with_nan_row(row: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _ = data(16)
    x = x.clone()
    x[row] = float("nan")
    return x, y


def in_batches(x: torch.Tensor, y: torch.Tensor, size: int = 4) -> list[fitdp.DataBatch]:
    """The rows as batches in order: fitdp refuses NaN in in-memory data before the first
    step (issue 17 item 8), and batches are how a model that meets NaN trains."""
    return [fitdp.DataBatch(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize("raise_error", [False, True])
def test_terminate_on_nan_stops_at_the_first_nan_batch(raise_error):
    """Keras: the first batch whose loss is NaN stops training after that batch; with
    `raise_error=True` a RuntimeError ends fit at once and `on_train_end` does not run."""
    x, y = with_nan_row(9)  # batch index 2 of 4-row batches
    logs, rec = batch_log_recorder()
    ended: list[bool] = []
    end = LambdaCallback(on_train_end=lambda logs: ended.append(True))
    model = fitdp_model()
    callbacks = [TerminateOnNaN(raise_error=raise_error), rec, end]
    if raise_error:
        with pytest.raises(RuntimeError, match="NaN"):
            model.fit(in_batches(x, y), epochs=3, callbacks=callbacks, verbose=0)
        assert len(logs) == 2 and ended == []  # raised before later callbacks saw batch 2
    else:
        model.fit(in_batches(x, y), epochs=3, callbacks=callbacks, verbose=0)
        assert len(logs) == 3 and ended == [True]


def test_terminate_on_nan_keras(keras):
    x, y = with_nan_row(9)
    fit = {"batch_size": 4, "epochs": 3, "shuffle": False, "verbose": 0}
    ours, rec = batch_log_recorder()
    theirs, krec = batch_log_recorder(keras.callbacks)
    fitdp_model().fit(in_batches(x, y), epochs=3, callbacks=[TerminateOnNaN(), rec],
                      verbose=0)
    keras_model(keras).fit(*np_(x, y), callbacks=[keras.callbacks.TerminateOnNaN(), krec],
                           **fit)
    assert len(ours) == len(theirs) == 3


# -- BackupAndRestore, TensorBoard --------------------------------------------------------------

def crash_at(epoch: int) -> LambdaCallback:
    """Ctrl-C at the start of `epoch`."""
    def begin(e: int, logs: dict[str, float]) -> None:
        if e == epoch:
            raise KeyboardInterrupt

    return LambdaCallback(on_epoch_begin=begin)


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    """Keras 3's `double_checkpoint`: the backup before the latest is kept, and a damaged
    latest backup is not resumed from: the run continues from the previous one."""
    x, y, _ = data(16)
    folder = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        fitdp_model().fit(x, y, epochs=4, verbose=0, callbacks=[
            BackupAndRestore(str(folder), double_checkpoint=True), crash_at(2)])
    latest = folder / "backup.ckpt"
    assert latest.is_file() and (folder / "backup.prev.ckpt").is_file()
    raw = bytearray(latest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    latest.write_bytes(bytes(raw))
    began: list[int] = []
    with pytest.warns(UserWarning, match="damaged"):
        h = fitdp_model().fit(x, y, epochs=4, verbose=0, callbacks=[
            BackupAndRestore(str(folder), double_checkpoint=True),
            LambdaCallback(on_epoch_begin=lambda epoch, logs: began.append(epoch))])
    assert began == [1, 2, 3] and h.epoch == [0, 1, 2, 3]  # epoch 0's backup, then on


def test_tensorboard_update_freq_and_histogram_freq(tmp_path):
    """Keras: `update_freq=N` writes batch scalars every N batches (counted over the run);
    `histogram_freq=N` writes weight histograms at epochs 0, N, 2N, ..."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y, _ = data(16)
    tb = TensorBoard(str(tmp_path), update_freq=3, histogram_freq=2)
    fitdp_model().fit(x, y, batch_size=4, epochs=3, callbacks=[tb], verbose=0)
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train_batch/loss")] == [3, 6, 9, 12]
    assert [e.step for e in events.Histograms("weights/weight")] == [0, 2]
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2]
