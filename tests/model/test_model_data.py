"""Data forms, metrics per device slice, predict order and once-per-epoch sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from torchmetrics.regression import MeanSquaredError

import fitdp
from fitdp.data.batch import DataBatch


def classification(n: int = 90, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def compiled(net: nn.Module | None = None, **kw) -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(net or nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.compile(optimizer="adam", lr=0.01, loss="cross_entropy", **kw)
    return model


class Recorder(nn.Module):
    """Records the first feature of every training sample it sees (its sample id)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x[:, 0].long().tolist()
        return self.lin(x)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"], ["cpu"] * 3])
def test_every_sample_once_per_epoch(devices):
    net = Recorder()
    x = torch.stack([torch.arange(47.0), torch.zeros(47)], 1)
    y = torch.zeros(47, dtype=torch.long)
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", loss="cross_entropy")
    model.fit(x, y, batch_size=8, epochs=2, devices=devices, verbose=0, seed=3)
    # replicas are copies with several devices: gather what every replica saw
    mgr = model._replicas.manager
    seen = sum((ex.module.seen for ex in mgr.execgrp.executors), [])
    assert sorted(seen) == sorted(list(range(47)) * 2)
    first_epoch_order = net.seen[:8] if len(devices) == 1 else None
    if first_epoch_order is not None:
        assert first_epoch_order != list(range(8))  # shuffled


def test_metrics_equal_torchmetrics_on_whole_epoch():
    x, y = classification(101)
    model = compiled(metrics=[MulticlassAccuracy(num_classes=3),
                              {"f1": MulticlassF1Score(num_classes=3, average="macro")}["f1"]])
    logs = model.evaluate(x, y, batch_size=16, devices=["cpu"] * 3, verbose=0)
    with torch.no_grad():
        out = model.module(x)
    assert logs["multiclass_accuracy"] == pytest.approx(
        float(MulticlassAccuracy(num_classes=3)(out, y)), abs=1e-6)
    assert logs["multiclass_f1_score"] == pytest.approx(
        float(MulticlassF1Score(num_classes=3, average="macro")(out, y)), abs=1e-6)
    assert logs["loss"] == pytest.approx(float(nn.functional.cross_entropy(out, y)), rel=1e-5)


def test_metric_dict_keys_and_history_per_epoch():
    x, y = classification()
    model = compiled(metrics={"acc": MulticlassAccuracy(num_classes=3)})
    h = model.fit(x, y, epochs=3, batch_size=16, devices=["cpu", "cpu"], validation_data=(x, y),
                  verbose=0)
    assert set(h.history) == {"loss", "acc", "val_loss", "val_acc", "lr"}
    assert all(len(v) == 3 for v in h.history.values())
    assert h.epoch == [0, 1, 2]
    assert h.history["loss"][-1] < h.history["loss"][0]


def test_regression_metric_with_mse():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = x.sum(1, keepdim=True)
    model = fitdp.Model(nn.Linear(6, 1))
    model.compile(optimizer="sgd", lr=0.05, loss="mse", metrics=[MeanSquaredError()])
    h = model.fit(x, y, epochs=5, batch_size=8, devices=["cpu", "cpu"], verbose=0)
    assert h.history["mean_squared_error"][-1] < h.history["mean_squared_error"][0]
    assert h.history["loss"][-1] == pytest.approx(h.history["mean_squared_error"][-1], rel=1e-4)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_predict_one_row_per_sample_in_order(devices):
    x, _ = classification(37)
    model = compiled()
    preds = model.predict(x, batch_size=8, devices=devices)
    assert preds.shape == (37, 3)
    torch.testing.assert_close(preds, model.module(x).detach(), rtol=1e-5, atol=1e-6)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(2, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


class NpDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def test_every_data_form_trains():
    x, y = classification(64)
    forms = {
        "tensors": ((x, y), {}),
        "numpy": ((x.double().numpy(), y.numpy()), {}),
        "tuple": (((x, y),), {}),
        "dataset": ((NpDataset(x, y),), {}),
        "tensor_dataset": ((TensorDataset(x, y),), {}),
        "dataloader": ((DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),), {}),
        "batches": (([DataBatch(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)],), {}),
    }
    for name, (args, kw) in forms.items():
        model = compiled()
        h = model.fit(*args, epochs=2, batch_size=16, devices=["cpu", "cpu"], verbose=0, **kw)
        assert model.global_step == 8, name
        assert len(h.history["loss"]) == 2, name


def test_multi_input_tuple_and_dict():
    x, y = classification(32)
    z = torch.randn(32, 2)
    model = compiled(TwoInputs())
    model.fit((x, z), y, batch_size=8, devices=["cpu", "cpu"], verbose=0)
    preds = model.predict((x, z), batch_size=8)
    torch.testing.assert_close(preds, model.module(x, z).detach())
    model.fit({"x": x, "z": z}, y, batch_size=8, devices=["cpu", "cpu"], verbose=0)
    preds = model.predict({"x": x, "z": z}, batch_size=8, devices=["cpu", "cpu"])
    torch.testing.assert_close(preds, model.module(x=x, z=z).detach())


def test_validation_split_takes_the_tail():
    x, y = classification(50)
    model = compiled()
    h = model.fit(x, y, validation_split=0.2, batch_size=8, verbose=0, shuffle=False)
    assert model.global_step == 5  # 40 training samples in batches of 8
    assert "val_loss" in h.history


def test_steps_per_epoch_and_initial_epoch():
    x, y = classification(64)
    model = compiled()
    h = model.fit(x, y, batch_size=8, epochs=4, initial_epoch=1, steps_per_epoch=3, verbose=0)
    assert model.global_step == 9
    assert h.epoch == [1, 2, 3]


def test_stop_training_ends_after_current_batch():
    x, y = classification(64)
    model = compiled()

    class StopAt(fitdp.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    h = model.fit(x, y, batch_size=8, epochs=5, callbacks=[StopAt()], verbose=0)
    assert model.global_step == 3
    assert len(h.history["loss"]) == 1


def test_seed_makes_runs_reproducible():
    x, y = classification(64)
    weights = []
    for _ in range(2):
        model = compiled()
        model.fit(x, y, batch_size=8, epochs=2, seed=7, verbose=0, devices=["cpu", "cpu"])
        weights.append(model.get_weights())
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k])


def test_numpy_float64_is_cast_like_keras():
    x, y = classification(16)
    model = compiled()
    preds = model.predict(np.asarray(x, dtype=np.float64), batch_size=4)
    assert preds.dtype == torch.float32


def test_modes_follow_the_user_between_calls():
    """Regression: predict left a one-device model in eval mode, and a cached mode flag then
    trained it in eval mode after the user switched it."""
    x, y = classification(32)
    model = compiled(nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3)))
    model.fit(x, y, batch_size=8, devices=["cpu"], verbose=0)
    model.predict(x, devices=["cpu"])
    model.evaluate(x, y, devices=["cpu"], verbose=0)
    assert model.module.training
    model.module.eval()
    seen = []
    model.module[1].register_forward_hook(lambda m, i, o: seen.append(m.training))
    model.fit(x, y, batch_size=8, devices=["cpu"], verbose=0)
    assert seen and all(seen)


def test_one_batch_calls_convert_their_inputs_once(monkeypatch):
    """Issue 30 item 7: ``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` read a
    numpy ``x`` once, as ``fit`` does (the batch is every row of the converted data), and
    equal ``fit``/``evaluate``/``predict`` with the whole data as one batch."""
    x, y = classification(12)
    x_np = x.numpy().astype(np.float64)  # converted (to float32) when read
    converted = []
    real = torch.from_numpy

    def spy(array):
        if array is x_np or getattr(array, "base", None) is x_np:
            converted.append(array.shape)
        return real(array)

    monkeypatch.setattr(torch, "from_numpy", spy)
    model, twin = compiled(), compiled()
    logs = model.train_on_batch(x_np, y.numpy(), return_dict=True)
    assert len(converted) == 1
    history = twin.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    assert logs["loss"] == pytest.approx(history.history["loss"][0], rel=1e-6)
    for a, b in zip(model.module.parameters(), twin.module.parameters()):
        torch.testing.assert_close(a, b)
    converted.clear()
    assert model.test_on_batch(x_np, y.numpy(), return_dict=True)["loss"] == pytest.approx(
        twin.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)["loss"], rel=1e-6)
    torch.testing.assert_close(model.predict_on_batch(x_np), twin.predict(x, batch_size=12))
    assert len(converted) == 2
