"""Model-level saving: weights files, background checkpoints, and the callbacks on them."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore, Callback, ModelCheckpoint
from fitdp.saving import async_writer

G = torch.Generator().manual_seed(2)
X, Y = torch.randn(48, 5, generator=G), torch.randint(0, 3, (48,), generator=G)


def make(seed: int = 0, out: int = 3) -> fitdp.Model:
    torch.manual_seed(seed)
    model = fitdp.Model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, out)))
    model.compile(optimizer="adam", lr=0.01)
    return model


def same_weights(a: fitdp.Model, b: fitdp.Model) -> bool:
    return all(torch.equal(v, b.module.state_dict()[k]) for k, v in a.module.state_dict().items())


@pytest.mark.parametrize("name", ["w.safetensors", "w.weights"])
def test_save_weights_and_load_weights_round_trip(tmp_path, name):
    model = make()
    model.fit(X, Y, devices=["cpu", "cpu"], verbose=0)
    model.save_weights(tmp_path / name)
    other = make(seed=1)
    other.load_weights(tmp_path / name)
    assert same_weights(model, other)
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        assert torch.equal(load_file(tmp_path / name)["2.weight"], model.module[2].weight)
    with pytest.raises(fitdp.CheckpointError, match=r"2.weight.*\(3, 8\).*\(4, 8\)"):
        make(out=4).load_weights(tmp_path / name)


def test_async_save_writes_what_a_synchronous_save_writes(tmp_path):
    model = make()
    model.fit(X, Y, verbose=0)
    model.save(tmp_path / "sync.ckpt")
    model.save(tmp_path / "async.ckpt", async_save=True)
    model.wait_for_saves()
    a = torch.load(tmp_path / "sync.ckpt", weights_only=True)
    b = torch.load(tmp_path / "async.ckpt", weights_only=True)
    assert a.keys() == b.keys()
    for k, v in a["module"].items():
        assert torch.equal(v, b["module"][k])
    assert a["run"] == b["run"] and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def test_checkpoint_callbacks_save_in_the_background_and_fit_waits(tmp_path):
    model = make()
    ckpt = ModelCheckpoint(str(tmp_path / "c-{epoch}.ckpt"), monitor="loss", keep=2,
                           async_save=True)
    model.fit(X, Y, epochs=4, batch_size=8, verbose=0, callbacks=[ckpt])
    files = sorted(p.name for p in tmp_path.glob("c-*.ckpt"))
    assert files == ["c-3.ckpt", "c-4.ckpt"]  # durable when fit returned, older ones pruned
    restored = make(seed=1)
    restored.load(tmp_path / "c-4.ckpt")
    assert same_weights(model, restored)


def test_weights_only_checkpoints_through_the_callback(tmp_path):
    """Keras's ModelCheckpoint(save_weights_only=True): the file holds the weights alone."""
    model = make()
    path = tmp_path / "best.safetensors"
    model.fit(X, Y, epochs=2, verbose=0, callbacks=[ModelCheckpoint(
        str(path), monitor="loss", save_best_only=True, save_weights_only=True)])
    other = make(seed=1)
    other.load_weights(path)
    assert same_weights(model, other)


def test_backup_in_the_background_resumes_bitwise(tmp_path):
    class Crash(fitdp.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == 9:
                raise KeyboardInterrupt

    ref = make()
    ref.fit(X, Y, epochs=3, batch_size=8, seed=3, verbose=0)
    backup = str(tmp_path / "b")
    model = make()
    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, epochs=3, batch_size=8, seed=3, verbose=0,
                  callbacks=[BackupAndRestore(backup, save_freq=2, async_save=True), Crash()])
    again = make()
    again.fit(X, Y, epochs=3, batch_size=8, seed=3, verbose=0,
              callbacks=[BackupAndRestore(backup, save_freq=2, async_save=True)])
    assert same_weights(again, ref)


def hold_copies(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The writer thread's deferred copy starts ``seconds`` late (as on a busy core)."""
    real = async_writer._copy

    def late(copies):
        time.sleep(seconds)
        real(copies)

    monkeypatch.setattr(async_writer, "_copy", late)


@pytest.mark.parametrize("devices", ["auto", ["cpu", "cpu"]])
@pytest.mark.parametrize("change", ["train_on_batch", "set_weights", "load"])
def test_weight_changes_wait_for_the_async_saves_copy(tmp_path, monkeypatch, devices, change):
    """Pins the snapshot fence: async_save copies weights and optimizer state on the writer
    thread; a step, set_weights or load right after must wait, or the file holds new weights."""
    model = make()
    model.fit(X, Y, devices=devices, verbose=0)
    other = make(seed=1)
    other.fit(X, Y, verbose=0)
    other.save(tmp_path / "other.ckpt")
    model.save(tmp_path / "sync.ckpt")
    hold_copies(monkeypatch, 0.5)
    t = time.perf_counter()
    model.save(tmp_path / "async.ckpt", async_save=True)
    assert time.perf_counter() - t < 0.4  # the copy is not in the call
    if change == "train_on_batch":
        model.train_on_batch(X[:16], Y[:16])
    elif change == "set_weights":
        model.set_weights(other.get_weights())
    else:
        model.load(tmp_path / "other.ckpt")
    assert time.perf_counter() - t >= 0.5  # it waited for the copy
    model.wait_for_saves()
    assert_same_files(tmp_path, model)


def assert_same_files(folder, model: fitdp.Model) -> None:
    """async.ckpt holds what sync.ckpt does, and the model trained on or loaded since."""
    a = torch.load(folder / "sync.ckpt", weights_only=True)
    b = torch.load(folder / "async.ckpt", weights_only=True)
    for k, v in a["module"].items():
        assert torch.equal(v, b["module"][k]), k
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)
    assert not torch.equal(model.get_weights()["0.weight"], a["module"]["0.weight"])


class SaveTwiceAtFirstBatch(Callback):
    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        if batch == 0:
            self.model.save(self.folder / "sync.ckpt")
            self.model.save(self.folder / "async.ckpt", async_save=True)


@pytest.mark.parametrize("devices", ["auto", ["cpu", "cpu"]])
def test_the_step_after_an_async_save_in_fit_waits_for_its_copy(tmp_path, monkeypatch, devices):
    """Pins the fence in Update.apply: fit's next optimizer step waits for the writer thread's
    copy of the weights (one device) and of the Adam state (both)."""
    model = make()
    hold_copies(monkeypatch, 0.3)
    model.fit(X, Y, batch_size=8, epochs=1, devices=devices, verbose=0,
              callbacks=[SaveTwiceAtFirstBatch(tmp_path)])
    assert_same_files(tmp_path, model)
