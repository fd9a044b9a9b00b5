"""Model.export: the averaged weights of a multi-device run, loadable without the class."""

from __future__ import annotations

import torch
from torch import nn

import fitdp
from fitdp.datasets import load_digits


def test_export_matches_predict_after_two_replica_training(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Flatten(), nn.Dropout(0.2), nn.Linear(4 * 64, 10))
    x, y = load_digits()
    x, y = x[:200], y[:200]
    model = fitdp.Model(net)
    model.compile(optimizer="adam", loss="cross_entropy")
    model.fit(x, y, batch_size=32, devices=["cpu", "cpu"], verbose=0)
    model.export(tmp_path / "digits.pt2", x[:4])
    predictor = fitdp.load_predictor(tmp_path / "digits.pt2")
    expected = model.predict(x[:37], batch_size=16, devices=["cpu", "cpu"])
    torch.testing.assert_close(predictor(x[:37]), expected, rtol=0, atol=1e-6)
    assert model.module.training  # the user's module keeps its mode
