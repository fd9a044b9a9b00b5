"""Unit tests of fitdp.callbacks, each callback driven by a fake model and hand-made logs."""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import math
import os
import re
import sys
import time
from unittest.mock import MagicMock, call

import pytest
import torch
from torch import nn

from fitdp.callbacks import (
    HOOKS,
    BackupAndRestore,
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    LambdaCallback,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    ReduceLROnPlateau,
    Speedometer,
    TensorBoard,
    TerminateOnNaN,
)

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
HAS_TB = importlib.util.find_spec("tensorboard") is not None


class FakeModel:
    """The part of fitdp.Model callbacks rely on."""

    def __init__(self, lrs: tuple[float, ...] = (0.1,)) -> None:
        torch.manual_seed(0)
        self.module = nn.Linear(3, 2)
        params = list(self.module.parameters())
        groups = [{"params": [p], "lr": lr} for p, lr in zip(params, lrs)]
        self.optimizer = torch.optim.SGD(groups, lr=lrs[0])
        self.stop_training = False
        self.is_main_process = True
        self.global_step = 0
        self.saved: list[str] = []

    def save(self, path: str) -> None:
        torch.save({"weights": self.get_weights(), "step": self.global_step}, path)
        self.saved.append(path)

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(weights)

    def nonfinite_weights(self) -> list[str]:
        return [k for k, t in self.module.state_dict().items() if not torch.isfinite(t).all()]

    def fill(self, value: float) -> None:
        with torch.no_grad():
            for p in self.module.parameters():
                p.fill_(value)


def attach(cb: Callback, model: FakeModel | None = None, **params: object) -> FakeModel:
    model = model or FakeModel()
    cb.set_model(model)
    cb.set_params({"epochs": 3, "steps": 4, "verbose": 1, "batch_size": 8, **params})
    return model


def run_epochs(cb: Callback, model: FakeModel, val_losses: list[float],
               each_epoch=None) -> list[int]:
    """Drive `cb` through epochs with the given val_loss; return the epochs run."""
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


# --- CallbackList -----------------------------------------------------------------------------

class OnlyEpochEnd(Callback):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append((self, epoch))


def test_callback_list_skips_hooks_nobody_overrides_and_keeps_order():
    seen: list = []
    a, b = OnlyEpochEnd(seen), OnlyEpochEnd(seen)
    cbs = CallbackList([a, b], add_history=True)
    assert cbs._hooks["on_train_batch_end"] == []
    assert isinstance(cbs.callbacks[0], History) and cbs.history is cbs.callbacks[0]
    cbs.call("on_epoch_end", 0, {"loss": 1.0})
    assert seen == [(a, 0), (b, 0)]
    assert cbs.history.history == {"loss": [1.0]}


def test_callback_list_order_with_mocks():
    manager = MagicMock()
    first, second = MagicMock(spec=Callback), MagicMock(spec=Callback)
    manager.attach_mock(first, "first")
    manager.attach_mock(second, "second")
    cbs = CallbackList([first, second], model="m", params={"epochs": 1})
    assert not cbs.sync_every_batch  # a mock's attribute is not the literal True
    manager.reset_mock()
    cbs.call("on_train_begin", {})
    cbs.call("on_train_batch_end", 0, {"loss": 1.0})
    assert manager.mock_calls == [
        call.first.on_train_begin({}), call.second.on_train_begin({}),
        call.first.on_train_batch_end(0, {"loss": 1.0}),
        call.second.on_train_batch_end(0, {"loss": 1.0})]


def test_callback_list_defaults_history_first_progbar_last():
    user = OnlyEpochEnd([])
    cbs = CallbackList([user], add_history=True, add_progbar=True, verbose=1)
    assert [type(c) for c in cbs] == [History, OnlyEpochEnd, ProgressBar]
    assert [type(c) for c in CallbackList([], add_progbar=True, verbose=0)] == []
    mine = History()
    assert CallbackList([mine, user], add_history=True).history is mine


def test_callback_list_errors_and_flags():
    with pytest.raises(TypeError, match=r"EarlyStopping\(\.\.\.\)"):
        CallbackList([EarlyStopping])
    with pytest.raises(TypeError, match="Subclass Callback"):
        CallbackList([42])
    cbs = CallbackList([TerminateOnNaN()])
    assert cbs.sync_every_batch
    with pytest.raises(ValueError, match="on_epoch_end"):
        cbs.call("on_epoch_ends", 0, {})


def test_keras_batch_aliases_are_dispatched():
    class Old(Callback):
        def on_batch_end(self, batch, logs=None):
            self.got = batch

    cb = Old()
    CallbackList([cb]).call("on_train_batch_end", 7, {})
    assert cb.got == 7


def test_dispatch_is_cheap_with_only_history():
    cbs = CallbackList([], add_history=True)
    logs = {"loss": 1.0}
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(20000):
            cbs.call("on_train_batch_end", i, logs)
        best = min(best, (time.perf_counter() - t0) / 20000)
    assert best < 2e-6, f"{best * 1e9:.0f} ns per call"


# --- History ----------------------------------------------------------------------------------

def test_history_records_and_restarts_unless_restored():
    h = History()
    h.on_train_begin()
    h.on_epoch_end(0, {"loss": 2.0, "val_loss": 3.0})
    h.on_epoch_end(1, {"loss": 1.0, "val_loss": 2.0})
    assert h.history == {"loss": [2.0, 1.0], "val_loss": [3.0, 2.0]} and h.epoch == [0, 1]
    state = h.state_dict()
    h.on_train_begin()
    assert h.history == {} and h.epoch == []
    h.load_state_dict(state)
    h.on_train_begin()
    assert h.epoch == [0, 1]


def _history() -> History:
    h = History()
    h.on_train_begin()
    for e in range(3):
        h.on_epoch_end(e, {"loss": 1.0 / (e + 1), "multiclass_accuracy": 0.5 + e / 10,
                           "val_loss": 1.5 / (e + 1), "val_multiclass_accuracy": 0.4 + e / 10})
    return h


def test_history_plot(tmp_path):
    h, path = _history(), tmp_path / "history.png"
    if not HAS_MPL:
        with pytest.raises(ImportError, match="pip install matplotlib"):
            h.plot(path)
        return
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


# --- ProgressBar and Speedometer --------------------------------------------------------------

def _drive_progress(cb: Callback, model: FakeModel, epochs: int = 3, steps: int = 4) -> None:
    cb.on_train_begin({})
    for epoch in range(epochs):
        cb.on_epoch_begin(epoch, {})
        for batch in range(steps):
            cb.on_train_batch_begin(batch, {})
            cb.on_train_batch_end(batch, {"loss": 0.5, "multiclass_accuracy": 0.9612})
        cb.on_test_begin({})
        cb.on_test_batch_end(0, {"loss": 0.7})
        cb.on_test_end({"loss": 0.7})
        cb.on_epoch_end(epoch, {"loss": 0.5, "multiclass_accuracy": 0.9612, "val_loss": 0.7})
    cb.on_train_end({})


def test_progress_bar_prints_one_line_per_epoch_when_not_a_tty(capsys):
    bar = ProgressBar()
    model = attach(bar, epochs=3)
    _drive_progress(bar, model)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    pattern = (r"Epoch {}/3 - \d+s - [\d.]+ steps/s - loss: 0\.5000 - "
               r"multiclass_accuracy: 0\.9612 - val_loss: 0\.7000")
    for i, line in enumerate(lines):
        assert re.fullmatch(pattern.format(i + 1), line), line


def test_progress_bar_silent_off_main_process_and_verbose_0(capsys):
    quiet = ProgressBar(verbose=0)
    _drive_progress(quiet, attach(quiet))
    other_rank = ProgressBar()
    model = attach(other_rank)
    model.is_main_process = False
    _drive_progress(other_rank, model)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="verbose"):
        ProgressBar(verbose=3)


def test_progress_bar_draws_a_bar_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    monkeypatch.setattr(sys, "stdout", out)
    bar = ProgressBar()
    _drive_progress(bar, attach(bar, epochs=2), epochs=2)
    text = out.getvalue()
    assert "Epoch 1/2" in text and "Epoch 2/2" in text and "val_loss: 0.7000" in text
    assert "4/4" in text


def test_standalone_evaluate_prints_one_line(capsys):
    bar = ProgressBar()
    attach(bar)
    bar.on_test_begin({})
    bar.on_test_batch_end(0, {"loss": 0.25})
    bar.on_test_end({"loss": 0.25})
    assert re.fullmatch(r"Evaluate - \d+s - [\d.]+ steps/s - loss: 0\.2500\n",
                        capsys.readouterr().out)


def test_speedometer_logs_every_frequent_batches(caplog):
    speed = Speedometer(batch_size=4, frequent=2)
    model = attach(speed)
    with caplog.at_level(logging.INFO, logger="fitdp"):
        _drive_progress(speed, model, epochs=1, steps=5)
    msgs = [r.getMessage() for r in caplog.records if r.name == "fitdp"]
    assert len(msgs) == 2
    assert re.fullmatch(r"Epoch\[0\] Batch \[0-2\]\tSpeed: [\d.]+ samples/sec\tloss=0\.500000"
                        r"\tmulticlass_accuracy=0\.961200", msgs[0])
    assert msgs[1].startswith("Epoch[0] Batch [2-4]\tSpeed: ")
    caplog.clear()
    model.is_main_process = False
    with caplog.at_level(logging.INFO, logger="fitdp"):
        _drive_progress(speed, model, epochs=1, steps=5)
    assert not caplog.records
    with pytest.raises(ValueError, match="frequent"):
        Speedometer(32, frequent=0)


# --- LambdaCallback ---------------------------------------------------------------------------

def test_lambda_callback_dispatch():
    got = []
    cb = LambdaCallback(on_epoch_end=lambda e, logs: got.append(("end", e, logs["loss"])),
                        on_train_begin=lambda logs: got.append("begin"),
                        on_test_end=lambda logs: got.append("test"))
    cbs = CallbackList([cb])
    assert cbs._hooks["on_train_batch_end"] == [] and len(cbs._hooks["on_test_end"]) == 1
    cbs.call("on_train_begin", {})
    cbs.call("on_epoch_end", 2, {"loss": 0.5})
    cbs.call("on_test_end", {})
    assert got == ["begin", ("end", 2, 0.5), "test"]
    with pytest.raises(TypeError, match="on_epoch_ends"):
        LambdaCallback(on_epoch_ends=print)
    with pytest.raises(TypeError, match="on_train_end"):
        LambdaCallback(on_train_end=3)


# --- ModelCheckpoint --------------------------------------------------------------------------

def test_model_checkpoint_formats_epoch_and_log_keys(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "ckpt-{epoch:02d}-{val_loss:.3f}.ckpt"))
    model = attach(ckpt)
    run_epochs(ckpt, model, [0.5, 0.25])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-01-0.500.ckpt", "ckpt-02-0.250.ckpt"]
    assert ckpt.latest_checkpoint() == str(tmp_path / "ckpt-02-0.250.ckpt")
    assert ckpt.best == 0.25
    bad = ModelCheckpoint(str(tmp_path / "{epoch}-{val_acc}.ckpt"))
    attach(bad, model)
    with pytest.raises(KeyError, match=r"val_acc.*Available keys: epoch, loss, step, val_loss"):
        bad.on_epoch_end(0, {"loss": 1.0, "val_loss": 1.0})


def test_model_checkpoint_keep_removes_oldest_after_the_new_one(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), keep=2)
    model = attach(ckpt)
    run_epochs(ckpt, model, [4.0, 3.0, 2.0, 1.0])
    assert sorted(os.listdir(tmp_path)) == ["e3.ckpt", "e4.ckpt"]
    assert model.saved == [str(tmp_path / f"e{i}.ckpt") for i in range(1, 5)]


def test_model_checkpoint_save_best_only_and_mode_auto(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), save_best_only=True)
    model = attach(ckpt)
    run_epochs(ckpt, model, [1.0, 2.0, 0.5, 0.5])
    assert sorted(os.listdir(tmp_path)) == ["e1.ckpt", "e3.ckpt"] and ckpt.best == 0.5
    assert ModelCheckpoint("x", monitor="val_multiclass_accuracy").mode == "max"
    assert ModelCheckpoint("x", monitor="val_f1_score").mode == "max"
    assert ModelCheckpoint("x", monitor="val_loss").mode == "min"
    assert ModelCheckpoint("x", monitor="val_acc", mode="min").mode == "min"
    with pytest.raises(ValueError, match=r"mode=.*'best'.*'auto', 'min' or 'max'"):
        ModelCheckpoint("x", mode="best")
    with pytest.raises(ValueError, match="keep"):
        ModelCheckpoint("x", keep=0)
    with pytest.raises(ValueError, match=r"save_freq.*'epoch'"):
        ModelCheckpoint("x", save_freq="batch")
    with pytest.raises(ValueError, match="positional"):
        ModelCheckpoint("ckpt-{}.ckpt")


def test_model_checkpoint_missing_monitor_warns_with_available_keys(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "best.ckpt"), save_best_only=True)
    attach(ckpt)
    with pytest.warns(RuntimeWarning, match=r"'val_loss'.*Available keys: loss"):
        ckpt.on_epoch_end(0, {"loss": 1.0})
    assert not os.listdir(tmp_path)


def test_model_checkpoint_refuses_nan(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"))
    model = attach(ckpt)
    with pytest.warns(RuntimeWarning, match="loss is nan"):
        ckpt.on_epoch_end(0, {"loss": float("nan"), "val_loss": 1.0})
    with pytest.warns(RuntimeWarning, match="val_loss is inf"):
        ckpt.on_epoch_end(1, {"loss": 1.0, "val_loss": float("inf")})
    model.fill(float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite values in weight"):
        ckpt.on_epoch_end(2, {"loss": 1.0, "val_loss": 1.0})
    assert not os.listdir(tmp_path) and ckpt.best is None


def test_model_checkpoint_step_frequency_and_resume_state(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "s{step}.ckpt"), save_freq=3, keep=2)
    model = attach(ckpt)
    ckpt.on_train_begin({})
    ckpt.on_epoch_begin(0, {})
    for batch in range(7):
        model.global_step = batch + 1
        ckpt.on_train_batch_end(batch, {"loss": 1.0})
        ckpt.on_train_batch_end(batch, {"loss": 1.0})  # a repeated step saves once
    ckpt.on_epoch_end(0, {"loss": 1.0, "val_loss": 1.0})  # no epoch save with int save_freq
    assert model.saved == [str(tmp_path / "s3.ckpt"), str(tmp_path / "s6.ckpt")]
    state = ckpt.state_dict()
    torch.save(state, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    again = ModelCheckpoint(str(tmp_path / "s{step}.ckpt"), save_freq=3, keep=1)
    assert again.latest_checkpoint() == str(tmp_path / "s6.ckpt")  # found on disk
    again.load_state_dict(state)
    attach(again, model)
    model.global_step = 9
    again.on_train_batch_end(0, {"loss": 1.0})
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".ckpt")) == ["s9.ckpt"]


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


# --- BackupAndRestore -------------------------------------------------------------------------

def test_backup_and_restore_paths(tmp_path):
    backup = BackupAndRestore(str(tmp_path / "bk"))
    model = attach(backup)
    assert backup.resume_path() is None and backup.latest_checkpoint() is None
    backup.on_train_begin({})
    backup.on_epoch_end(0, {"loss": 1.0})
    path = str(tmp_path / "bk" / "backup.ckpt")
    assert backup.resume_path() == path == backup.latest_checkpoint()
    assert torch.load(path, weights_only=True)["step"] == 0
    backup.on_train_end({})
    assert backup.resume_path() is None and not (tmp_path / "bk").exists()
    kept = BackupAndRestore(tmp_path / "bk2", save_freq=2, delete_checkpoint=False)
    attach(kept, model)
    for step in range(1, 4):
        model.global_step = step
        kept.on_train_batch_end(step - 1, {})
        kept.on_epoch_end(0, {})  # int save_freq: no epoch saves
    kept.on_train_end({})
    assert model.saved[-1] == str(tmp_path / "bk2" / "backup.ckpt") and len(model.saved) == 2
    assert torch.load(kept.resume_path(), weights_only=True)["step"] == 2
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(tmp_path, save_freq=-1)


# --- EarlyStopping ----------------------------------------------------------------------------

def test_early_stopping_patience_and_restore_best_weights():
    stop = EarlyStopping(patience=2, restore_best_weights=True)
    model = attach(stop)
    done = run_epochs(stop, model, [1.0, 0.5, 0.6, 0.7, 0.8, 0.9], each_epoch=model.fill)
    assert done == [0, 1, 2, 3] and stop.stopped_epoch == 3 and stop.best_epoch == 1
    assert all(bool((p == 1.0).all()) for p in model.module.parameters())  # epoch 1's weights


def test_early_stopping_restores_at_train_end_without_stopping_like_keras3():
    stop = EarlyStopping(patience=5, restore_best_weights=True)
    model = attach(stop)
    done = run_epochs(stop, model, [1.0, 0.5, 0.6], each_epoch=model.fill)
    assert done == [0, 1, 2] and stop.stopped_epoch == 0
    assert all(bool((p == 1.0).all()) for p in model.module.parameters())


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
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=-1)
    with pytest.warns(RuntimeWarning, match="Available keys: loss"):
        EarlyStopping().on_epoch_end(0, {"loss": 1.0})


def test_early_stopping_state_survives_resume():
    stop = EarlyStopping(patience=3)
    attach(stop)
    stop.on_train_begin()
    stop.on_epoch_end(0, {"val_loss": 1.0})
    stop.on_epoch_end(1, {"val_loss": 2.0})
    again = EarlyStopping(patience=3)
    model = attach(again)
    again.load_state_dict(stop.state_dict())
    again.on_train_begin()
    again.on_epoch_end(2, {"val_loss": 2.0})
    again.on_epoch_end(3, {"val_loss": 2.0})
    assert again.best == 1.0 and model.stop_training and again.stopped_epoch == 3


# --- Learning rate ----------------------------------------------------------------------------

def test_reduce_lr_on_plateau_reduction_and_cooldown():
    plateau = ReduceLROnPlateau(factor=0.5, patience=1, cooldown=2)
    model = attach(plateau)
    plateau.on_train_begin({})
    lrs, logged = [], []
    for epoch in range(6):
        logs = {"val_loss": 1.0}
        plateau.on_epoch_end(epoch, logs)
        lrs.append(model.optimizer.param_groups[0]["lr"])
        logged.append(logs["lr"])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025, 0.0125]) and logged == lrs


def test_reduce_lr_on_plateau_min_lr_state_and_errors():
    plateau = ReduceLROnPlateau(factor=0.1, patience=0, min_lr=0.005)
    model = attach(plateau)
    plateau.on_train_begin({})
    for epoch in range(4):
        plateau.on_epoch_end(epoch, {"val_loss": 1.0})
    assert model.optimizer.param_groups[0]["lr"] == 0.005
    again = ReduceLROnPlateau(patience=2)
    attach(again)
    again.load_state_dict({"best": 0.3, "wait": 1, "cooldown_counter": 0})
    again.on_train_begin({})
    assert again.best == 0.3 and again.wait == 1
    with pytest.raises(ValueError, match=r"factor=.*1\.5.*0 <= factor < 1"):
        ReduceLROnPlateau(factor=1.5)
    with pytest.raises(ValueError, match="cooldown"):
        ReduceLROnPlateau(cooldown=-1)


def test_learning_rate_scheduler_sets_every_group_and_logs_lr():
    sched = LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch > 0 else lr)
    model = attach(sched, FakeModel(lrs=(0.1, 0.01)))
    logs: dict[str, float] = {}
    for epoch in range(3):
        sched.on_epoch_begin(epoch, {})
        sched.on_epoch_end(epoch, logs)
    assert [g["lr"] for g in model.optimizer.param_groups] == pytest.approx([0.025, 0.0025])
    assert logs["lr"] == pytest.approx(0.025)
    old_api = LearningRateScheduler(lambda epoch: 0.2 / (epoch + 1))
    model = attach(old_api)
    old_api.on_epoch_begin(1, {})
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    bad = LearningRateScheduler(lambda epoch, lr: "fast")
    attach(bad)
    with pytest.raises(ValueError, match="returned 'fast' for epoch 0"):
        bad.on_epoch_begin(0, {})
    with pytest.raises(TypeError, match="schedule"):
        LearningRateScheduler(0.1)


# --- TerminateOnNaN ---------------------------------------------------------------------------

def test_terminate_on_nan(caplog):
    stop = TerminateOnNaN()
    model = attach(stop)
    assert stop.sync_every_batch
    stop.on_train_batch_end(0, {"loss": 1.0})
    assert not model.stop_training
    with caplog.at_level(logging.WARNING, logger="fitdp"):
        stop.on_train_batch_end(1, {"loss": float("nan")})
    assert model.stop_training and "Batch 1: invalid loss nan" in caplog.text


# --- CSVLogger --------------------------------------------------------------------------------

def _read(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_logger_columns_late_keys_and_append(tmp_path):
    path = tmp_path / "logs" / "train.csv"
    logger = CSVLogger(path)
    attach(logger)
    logger.on_train_begin({})
    logger.on_epoch_end(0, {"loss": 1.0, "acc": 0.5})
    assert _read(path) == [["epoch", "acc", "loss"], ["0", "0.5", "1.0"]]  # flushed already
    logger.on_epoch_end(1, {"loss": 0.5, "acc": 0.6, "val_loss": 0.7})
    logger.on_train_end({})
    assert _read(path) == [["epoch", "acc", "loss", "val_loss"], ["0", "0.5", "1.0", "NA"],
                           ["1", "0.6", "0.5", "0.7"]]
    again = CSVLogger(path, append=True)
    attach(again)
    again.on_train_begin({})
    again.on_epoch_end(2, {"loss": 0.25, "acc": 0.7, "val_loss": 0.5})
    again.on_train_end({})
    rows = _read(path)
    assert len(rows) == 4 and rows[0][0] == "epoch" and rows[3] == ["2", "0.7", "0.25", "0.5"]
    fresh = CSVLogger(path, separator=";")
    attach(fresh)
    fresh.on_train_begin({})
    fresh.on_epoch_end(0, {"loss": 1.0})
    fresh.on_train_end({})
    assert path.read_text().splitlines() == ["epoch;loss", "0;1.0"]
    with pytest.raises(ValueError, match="separator"):
        CSVLogger(path, separator=", ")


def test_csv_logger_writes_nothing_off_main_process(tmp_path):
    logger = CSVLogger(tmp_path / "train.csv")
    attach(logger).is_main_process = False
    logger.on_train_begin({})
    logger.on_epoch_end(0, {"loss": 1.0})
    logger.on_train_end({})
    assert not os.listdir(tmp_path)


# --- TensorBoard ------------------------------------------------------------------------------

def test_tensorboard_writes_event_files(tmp_path):
    if not HAS_TB:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            TensorBoard(tmp_path)
        return
    tb = TensorBoard(tmp_path / "tb")
    attach(tb)
    tb.on_train_begin({})
    tb.on_epoch_end(0, {"loss": 1.0, "val_loss": 2.0})
    tb.on_train_end({})
    files = os.listdir(tmp_path / "tb")
    assert any(f.startswith("events.out.tfevents") for f in files)


def test_tensorboard_missing_package_is_a_clear_import_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"`tensorboard` package.*pip install tensorboard"):
        TensorBoard(tmp_path)


def test_every_hook_exists_on_callback():
    cb = Callback()
    for hook in HOOKS:
        assert callable(getattr(cb, hook))


def test_history_records_lr_added_by_a_later_callback():
    """Regression: History runs first, so `lr` (added by LR callbacks after it) was lost."""
    from fitdp.callbacks import LearningRateScheduler

    h, sched = History(), LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    model = FakeModel()
    cbs = CallbackList([sched], model=model, add_history=True)
    cbs.call("on_train_begin", {})
    for epoch in range(2):
        cbs.call("on_epoch_begin", epoch, {})
        cbs.call("on_epoch_end", epoch, {"loss": 1.0})
    cbs.call("on_train_end", {})
    assert cbs.history.history["lr"] == [0.05, 0.025]
    assert h.history == {}
