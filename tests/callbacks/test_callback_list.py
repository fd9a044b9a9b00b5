"""CallbackList: dispatch, order, the flags the model reads, and callback state by stable key."""

from __future__ import annotations

import io
import math
import time
from unittest.mock import MagicMock, call

import pytest
import torch
from callback_helpers import FakeModel

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
    TerminateOnNaN,
    state_keys,
)


class OnlyEpochEnd(Callback):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append((self, epoch))


class Counter(Callback):
    """A stateful user callback with the default key (its class name)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def on_train_begin(self, logs=None):
        self.n = 0

    def on_epoch_end(self, epoch, logs=None):
        self.n += 1

    def state_dict(self):
        return {"n": self.n} if self.n else {}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_callback_list_skips_hooks_nobody_overrides_and_keeps_order():
    seen: list = []
    a, b = OnlyEpochEnd(seen), OnlyEpochEnd(seen)
    cbs = CallbackList([a, b], add_history=True)
    assert cbs._hooks["on_train_batch_end"] == []
    assert isinstance(cbs.callbacks[0], History) and cbs.history is cbs.callbacks[0]
    cbs.call("on_epoch_end", 0, {"loss": 1.0})
    assert seen == [(a, 0), (b, 0)]
    assert cbs.history.history == {"loss": [1.0]}


def test_a_hooks_list_stays_current_when_a_callback_is_added():
    """A batch loop holds ``hook(name)`` for the call and tests it before each batch: a
    callback added on the way (``append``) is called from the next batch on."""
    seen: list = []

    class BatchEnd(Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    cbs = CallbackList([OnlyEpochEnd(seen)])
    ends = cbs.hook("on_train_batch_end")
    assert ends == []
    cbs.append(BatchEnd())
    assert ends is cbs.hook("on_train_batch_end") and len(ends) == 1
    cbs.call("on_train_batch_end", 3, {})
    assert seen == [3]


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
    with pytest.raises(TypeError, match=r"callbacks\[0\]: got the class EarlyStopping; .*"
                                         r"Fix: pass EarlyStopping\(\.\.\.\) instead"):
        CallbackList([EarlyStopping])
    with pytest.raises(TypeError, match="Fix: subclass Callback"):
        CallbackList([42])
    cbs = CallbackList([TerminateOnNaN()])
    assert cbs.sync_every_batch
    with pytest.raises(ValueError, match=r"hook_name=...\): got 'on_epoch_ends'.*on_epoch_end"):
        cbs.call("on_epoch_ends", 0, {})


def test_keras_batch_aliases_are_dispatched():
    class Old(Callback):
        def on_batch_end(self, batch, logs=None):
            self.got = batch

    cb = Old()
    CallbackList([cb]).call("on_train_batch_end", 7, {})
    assert cb.got == 7


def test_append_gets_model_and_params():
    model = FakeModel()
    cbs = CallbackList([], model=model, params={"epochs": 2})
    seen = OnlyEpochEnd([])
    cbs.append(seen)
    assert seen.model is model and seen.params == {"epochs": 2}
    cbs.call("on_epoch_end", 0, {})
    assert seen.seen == [(seen, 0)]


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


def test_every_hook_exists_on_callback():
    cb = Callback()
    for hook in HOOKS:
        assert callable(getattr(cb, hook))


def test_needs_batch_logs_only_when_a_batch_hook_reads_them(tmp_path):
    """The model reads exact batch logs on the CPU only when some callback needs them."""
    quiet = [History(), ProgressBar(verbose=0), Speedometer(8), CSVLogger(tmp_path / "l.csv"),
             EarlyStopping(), ReduceLROnPlateau(), LearningRateScheduler(lambda e, lr: lr),
             BackupAndRestore(tmp_path / "bk", save_freq=2),
             ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"))]
    assert not CallbackList(quiet).needs_batch_logs
    for reader in (ModelCheckpoint(str(tmp_path / "s{batch}.ckpt"), save_freq=5),
                   TerminateOnNaN(), LambdaCallback(on_train_batch_end=print),
                   LambdaCallback(on_test_batch_end=print), MagicMock(spec=Callback)):
        assert CallbackList([*quiet, reader]).needs_batch_logs, reader

    class EpochOnly(Callback):  # reads no batch logs, though it keeps the default True
        def on_epoch_end(self, epoch, logs=None):
            pass

    assert not CallbackList([EpochOnly()]).needs_batch_logs


def test_state_keys_are_stable_and_unique(tmp_path):
    """Keys name the callback and what it watches or writes; duplicates get #2, #3."""
    cbs = [History(), EarlyStopping(), EarlyStopping(monitor="val_acc"), EarlyStopping(),
           ModelCheckpoint(str(tmp_path / "a.ckpt")), ModelCheckpoint(str(tmp_path / "b.ckpt")),
           BackupAndRestore("bk"), ReduceLROnPlateau("loss"), Counter(), Counter(),
           MagicMock(spec=Callback)]
    assert state_keys(cbs) == [
        "History", "EarlyStopping[val_loss]", "EarlyStopping[val_acc]",
        "EarlyStopping[val_loss]#2", f"ModelCheckpoint[{tmp_path / 'a.ckpt'}]",
        f"ModelCheckpoint[{tmp_path / 'b.ckpt'}]", "BackupAndRestore[bk]",
        "ReduceLROnPlateau[loss]", "Counter", "Counter#2", "MagicMock"]
    # A user key that looks like a suffixed one still leaves every key unique.
    keys = state_keys([Counter(), OddKey(), Counter()])
    assert keys == ["Counter", "Counter#2", "Counter#3"]


class KeyedCounter(Counter):
    state_key = "counter"  # type: ignore[assignment]


class OddKey(Counter):
    state_key = "Counter#2"  # type: ignore[assignment]


def test_callback_list_state_dict_round_trip():
    """Only non-empty states are saved; a resumed list loads them after on_train_begin."""
    a, b, idle = Counter(), Counter(), Counter()
    cbs = CallbackList([a, b, idle], add_history=True)
    cbs.call("on_train_begin", {})
    for epoch in range(2):
        cbs.call("on_epoch_end", epoch, {"loss": 1.0})
    a.n, b.n, idle.n = 2, 5, 0
    states = cbs.state_dict()
    assert states == {"History": {"history": {"loss": [1.0, 1.0]}, "epoch": [0, 1]},
                      "Counter": {"n": 2}, "Counter#2": {"n": 5}}
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == states  # plain containers only
    again = CallbackList([Counter(), Counter(), Counter()], add_history=True)
    again.call("on_train_begin", {})  # the model's order: begin first, then load
    again.load_state_dict({**states, "Gone[x]": {"n": 9}})  # unknown keys are ignored
    assert [getattr(cb, "n", None) for cb in again] == [None, 2, 5, 0]
    assert again.history.epoch == [0, 1]


def test_load_state_dict_skips_callbacks_without_the_method():
    duck = MagicMock(spec=["on_epoch_end"])
    cbs = CallbackList([duck, KeyedCounter()])
    cbs.load_state_dict({"MagicMock": {"n": 1}, "counter": {"n": 3}})
    assert cbs.callbacks[1].n == 3
