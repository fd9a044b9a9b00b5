"""A checkpoint that does not fit is refused before anything is applied (issue 28 items 2
and 3; STYLE.md item 18: every entry is checked before any is loaded): the model keeps its
weights, optimizer state and ``global_step``, as ``torch.load_state_dict`` would leave a
module whose ``strict`` check failed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import fitdp
from fitdp.callbacks import LambdaCallback, ModelCheckpoint

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(32, 6, generator=G), torch.randint(0, 3, (32,), generator=G)


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def gan_model(names: tuple[str, str], seed: int) -> fitdp.Model:
    """Two optimizers by name, one per layer (a GAN's discriminator and generator)."""
    torch.manual_seed(seed)
    model = fitdp.Model(net())
    d, g = names
    model.compile(optimizer={d: torch.optim.SGD(model.module[0].parameters(), lr=0.1),
                             g: torch.optim.Adam(model.module[2].parameters(), lr=0.01)},
                  loss="cross_entropy")
    return model


def snapshot(model: fitdp.Model) -> dict[str, Any]:
    """Weights, optimizer state and step, copied."""
    return {"weights": {k: v.clone() for k, v in model.get_weights().items()},
            "optimizer": copy.deepcopy(model.optimizer.state_dict()),
            "step": model.global_step}


def assert_same(a: Any, b: Any) -> None:
    """Equal trees, tensors compared with ``torch.equal``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    else:
        assert a == b


def trained(model: fitdp.Model) -> fitdp.Model:
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    return model


def test_a_checkpoint_of_other_optimizer_names_is_refused_before_anything_loads(tmp_path):
    """Regression (issue 28 item 2): a checkpoint saved with optimizers {"d", "g"}, loaded
    into a model compiled with {"disc", "gen"}, raised a ValueError after the weights were
    written; with fit(resume=) the weights were replaced and global_step stayed 0. It is a
    CheckpointError naming both sets of names, and nothing changes (checkpoints.md: "a
    checkpoint of another model ... changes nothing")."""
    path = str(tmp_path / "gan.ckpt")
    trained(gan_model(("d", "g"), seed=0)).save(path)
    other = trained(gan_model(("disc", "gen"), seed=1))
    before = snapshot(other)
    with pytest.raises(fitdp.CheckpointError, match=r"optimizers \['d', 'g'\].*\['disc', "
                       r"'gen'\].*nothing was loaded"):
        other.load(path)
    assert_same(snapshot(other), before)
    with pytest.raises(fitdp.CheckpointError, match=r"optimizers \['d', 'g'\]"):
        other.fit(X, Y, batch_size=8, epochs=3, verbose=0, resume=path)
    assert_same(snapshot(other), before)


def test_a_checkpoint_of_the_same_optimizer_names_still_loads(tmp_path):
    """The check refuses only what does not fit: the same names load, state and all."""
    path = str(tmp_path / "gan.ckpt")
    saved = trained(gan_model(("d", "g"), seed=0))
    saved.save(path)
    other = gan_model(("d", "g"), seed=1)
    other.load(path)
    assert_same(other.get_weights(), saved.get_weights())
    assert_same(other.optimizer.state_dict(), saved.optimizer.state_dict())


def test_an_optimizer_part_of_another_kind_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "gan.ckpt")
    trained(gan_model(("d", "g"), seed=0)).save(path)
    torch.manual_seed(1)
    other = fitdp.Model(net())
    other.compile(optimizer={"d": torch.optim.SGD(other.module[0].parameters(), lr=0.1),
                             "g": torch.optim.RMSprop(other.module[2].parameters())},
                  loss="cross_entropy")
    before = snapshot(other)
    with pytest.raises(fitdp.CheckpointError, match=r"optimizer 'g': its hyperparameters"):
        other.load(path)
    assert_same(snapshot(other), before)


class Stream(IterableDataset):
    """The rows in order, once per iter(); cannot say its position."""

    def __iter__(self):
        for i in range(len(X)):
            yield X[i], Y[i]


def crash_after(batches: int) -> LambdaCallback:
    seen = []

    def end(batch: int, logs: dict[str, float]) -> None:
        seen.append(batch)
        if len(seen) == batches:
            raise KeyboardInterrupt

    return LambdaCallback(on_train_batch_end=end)


def model_of(**compile_kw: Any) -> fitdp.Model:
    """The same initial weights every time, compiled with ``compile_kw``."""
    torch.manual_seed(3)
    model = fitdp.Model(net())
    model.compile(loss="cross_entropy", **compile_kw)
    return model


def stream_model() -> fitdp.Model:
    return model_of(optimizer="adam", lr=0.01)


def test_a_refused_stream_resume_leaves_the_model_as_it_was(tmp_path):
    """Regression (issue 28 item 3): fit(stream, resume=ckpt) of a mid-epoch checkpoint of a
    stream that cannot say its position raised the documented ValueError (data.md,
    Streams) only after the model held the checkpoint's weights, optimizer state and
    global_step. The refusal comes first and the model is as it was."""
    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        stream_model().fit(Stream(), batch_size=8, epochs=3, verbose=0,
                           callbacks=[ckpt, crash_after(6)])  # epoch 1, batch 2
    model = stream_model()
    model.fit(X[:8], Y[:8], batch_size=8, epochs=1, verbose=0)  # some optimizer state
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"^resume: got a checkpoint taken mid-epoch \(2 "
                       r"batches into epoch 1\) of a DataLoader over Stream"):
        model.fit(Stream(), batch_size=8, epochs=3, verbose=0, callbacks=[ckpt],
                  resume="latest")
    assert_same(snapshot(model), before)
    # The same checkpoint of the in-memory rows resumes (only the stream cannot continue).
    model.fit(DataLoader(list(zip(X, Y)), batch_size=8), epochs=3, verbose=0,
              callbacks=[ckpt], resume="latest")
    assert model.global_step == 12


def test_a_checkpoint_of_other_data_is_refused_before_anything_loads(tmp_path):
    """Regression: resuming a fit on a DataLoader with in-memory tensors raised KeyError
    'seed' after the weights were written. A CheckpointError naming the data entry, and the
    model unchanged."""
    path = str(tmp_path / "loader.ckpt")
    saver = stream_model()
    saver.fit(DataLoader(list(zip(X, Y)), batch_size=8), epochs=1, verbose=0,
              callbacks=[ModelCheckpoint(path)])
    model = stream_model()
    model.fit(X[:8], Y[:8], batch_size=8, epochs=1, verbose=0)
    before = snapshot(model)
    with pytest.raises(fitdp.CheckpointError, match=r"data state does not fit.*\['seed'\]"):
        model.fit(X, Y, batch_size=8, epochs=3, verbose=0, resume=path)
    assert_same(snapshot(model), before)


def scheduled_model() -> fitdp.Model:
    return model_of(optimizer="adam", lr=0.01,
                    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))


@pytest.mark.parametrize(("key", "bad"), [
    ("rng", {"torch": torch.zeros(2, dtype=torch.uint8)}),  # no python/numpy states
    ("scheduler", [0.5]),
    ("run", {"epoch": "1", "epoch_done": True, "global_step": 4, "batch": 0}),
    ("callbacks", {"History": 3}),
    ("logs", {"loss": 1.5}),
])
def test_a_damaged_entry_is_refused_before_any_entry_loads(tmp_path, key, bad):
    """Regression (STYLE.md item 18, "every entry is checked before anything is applied"):
    a resume whose RNG, scheduler, run, callback or epoch-log entry could not load failed
    after the weights and optimizer state were written (the RNG and callbacks after
    on_train_begin, the logs at the first batch). Each is a CheckpointError naming the entry,
    and the model is as it was."""
    path = str(tmp_path / "run.ckpt")
    saver = scheduled_model()
    saver.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[ModelCheckpoint(path)])
    state = fitdp.saving.checkpoint.load_checkpoint(path)
    if key == "logs":  # a mid-epoch checkpoint holds the epoch's logs
        state["run"] = {**state["run"], "epoch_done": False, "batch": 2}
    state[key] = bad
    fitdp.saving.checkpoint.save_checkpoint(path, state)
    model = scheduled_model()
    model.fit(X[:8], Y[:8], batch_size=8, epochs=1, verbose=0)
    before = snapshot(model)
    with pytest.raises(fitdp.CheckpointError, match=rf"{key} state does not fit this model"):
        model.fit(X, Y, batch_size=8, epochs=3, verbose=0, resume=path)
    assert_same(snapshot(model), before)


def keras_metric_model() -> fitdp.Model:
    return model_of(optimizer="sgd", lr=0.1, metrics=["accuracy"])


@pytest.mark.parametrize("crash_at", [2, 4])  # mid-epoch; after the epoch's last batch
def test_a_mid_epoch_resume_with_a_keras_metric_name_logs_the_uninterrupted_numbers(
        tmp_path, crash_at):
    """Regression: a fit compiled with metrics=["accuracy"] (a Keras name, built on the
    first batch) and resumed mid-epoch raised KeyError 'accuracy' after the weights were
    loaded. It resumes, and History equals the uninterrupted run's (checkpoints.md: the
    resumed epoch's metrics equal the uninterrupted run's), also when no batch of the
    epoch is left to build the metric."""
    kw = dict(batch_size=8, epochs=2, verbose=0, seed=1, devices=["cpu", "cpu"])
    reference = keras_metric_model().fit(X, Y, **kw).history
    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        keras_metric_model().fit(X, Y, callbacks=[ckpt, crash_after(crash_at)], **kw)
    resumed = keras_metric_model().fit(X, Y, callbacks=[ckpt], resume="latest", **kw)
    assert resumed.history == reference


def _rows(kind: str, n: int) -> dict[str, Any]:
    """The first ``n`` rows of X, Y as fit's arguments, as ``kind`` of data."""
    x, y = torch.cat([X, X])[:n], torch.cat([Y, Y])[:n]
    if kind == "tensors":
        return {"x": x, "y": y, "batch_size": 8}
    if kind == "dataset":
        return {"x": torch.utils.data.TensorDataset(x, y), "batch_size": 8}
    return {"x": DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)}


@pytest.mark.parametrize("kind", ["tensors", "dataset", "loader"])
def test_a_mid_epoch_checkpoint_is_refused_on_data_too_short_for_its_position(tmp_path, kind):
    """Regression (issue 37 item 4): a checkpoint taken 2 batches into 64 rows resumed
    silently on 10 rows (global_step 3, the old data's partial loss in History).
    checkpoints.md promises the position is checked against this fit's data: refused,
    naming both sizes, before anything changes."""
    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        stream_model().fit(**_rows(kind, 64), epochs=2, verbose=0,
                           callbacks=[ckpt, crash_after(2)])
    model = trained(stream_model())
    before = snapshot(model)
    with pytest.raises(fitdp.CheckpointError, match=r"data state does not fit.*2 batches "
                       r"\(16 samples\) into epoch 0, past the end of this "
                       r"fit's data, which has 10 samples"):
        model.fit(**_rows(kind, 10), epochs=2, verbose=0, resume=str(tmp_path / "c-002.ckpt"))
    assert_same(snapshot(model), before)
    # Data long enough for the position resumes (the checkpoint itself is sound).
    model.fit(**_rows(kind, 64), epochs=2, verbose=0, resume=str(tmp_path / "c-002.ckpt"))
    assert model.global_step == 16


def test_a_checkpoint_after_an_epochs_last_partial_batch_still_resumes(tmp_path):
    """The position after a partial last batch (5 batches of 8 on 36 rows) is not past the
    end of the same data: the check counts the rows the saved run had."""
    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        stream_model().fit(**_rows("tensors", 36), epochs=2, verbose=0,
                           callbacks=[ckpt, crash_after(5)])
    model = stream_model()
    model.fit(**_rows("tensors", 36), epochs=2, verbose=0, resume=str(tmp_path / "c-005.ckpt"))
    assert model.global_step == 10
