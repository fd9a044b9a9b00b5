"""Model-level saving: weights files, background checkpoints, and the callbacks on them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore, ModelCheckpoint

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
