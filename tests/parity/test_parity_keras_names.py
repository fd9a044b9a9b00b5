"""Keras's loss and metric names in fitdp against Keras 3 itself (torch backend) on the same
outputs: fitdp's names read logits, so Keras's losses run with from_logits=True and its
metrics on sigmoid/softmax probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fitdp.compiled.losses import Objective
from fitdp.compiled.metrics import DeviceMetrics, metric_specs
from tests.parity import twins

CPU2 = [torch.device("cpu")] * 2
g = torch.Generator().manual_seed(3)
N, C = 40, 4
LOGITS = torch.randn(N, C, generator=g) * 2
CLASSES = torch.randint(0, C, (N,), generator=g)
ONEHOT = F.one_hot(CLASSES, C).float()
BIN_LOGITS = torch.randn(N, 1, generator=g) * 2
BIN = (torch.rand(N, 1, generator=g) > 0.5).float()
MULTI = (torch.rand(N, C, generator=g) > 0.5).float()
REG, REG_T = torch.randn(N, 3, generator=g), torch.randn(N, 3, generator=g)
WEIGHTS = torch.rand(N, generator=g) + 0.5


@pytest.mark.parametrize(("ours", "theirs", "outputs", "targets"), [
    ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy", LOGITS, CLASSES),
    ("categorical_crossentropy", "CategoricalCrossentropy", LOGITS, ONEHOT),
    ("binary_crossentropy", "BinaryCrossentropy", BIN_LOGITS, BIN),
    ("mean_squared_error", "MeanSquaredError", REG, REG_T),
    ("mse", "MeanSquaredError", REG, REG_T),
    ("mae", "MeanAbsoluteError", REG, REG_T),
    ("huber", "Huber", REG, REG_T),
])
@pytest.mark.parametrize("weighted", [False, True])
def test_keras_loss_names_match_keras(keras: Any, ours: str, theirs: str, outputs: torch.Tensor,
                                      targets: torch.Tensor, weighted: bool) -> None:
    """Keras's loss names were refused by compile; now each equals Keras's loss."""
    kwargs = {"from_logits": True} if "Crossentropy" in theirs else {}
    loss = getattr(keras.losses, theirs)(**kwargs)
    w = WEIGHTS if weighted else None
    want = float(loss(*twins.np_(targets, outputs), sample_weight=None if w is None
                      else w.numpy()))
    got = float(Objective(ours)(outputs, targets, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _keras_metric(keras: Any, name: str, outputs: torch.Tensor, targets: torch.Tensor,
                  weights: torch.Tensor | None) -> float:
    """Keras's metric ``name`` on probabilities, as compile would build it."""
    from keras.src.trainers.compile_utils import get_metric
    probs = torch.sigmoid(outputs) if outputs.shape[1] == 1 or name in (
        "binary_accuracy",) or targets is MULTI else torch.softmax(outputs, 1)
    if name in ("mae", "mse"):
        probs = outputs
    y_true, y_pred = twins.np_(targets, probs)
    metric = get_metric(name, y_true, y_pred)
    metric.update_state(y_true, y_pred, sample_weight=None if weights is None
                        else weights.numpy())
    return float(metric.result())


@pytest.mark.parametrize(("name", "outputs", "targets"), [
    ("accuracy", LOGITS, CLASSES), ("accuracy", LOGITS, ONEHOT), ("accuracy", BIN_LOGITS, BIN),
    ("binary_accuracy", LOGITS, MULTI), ("sparse_categorical_accuracy", LOGITS, CLASSES),
    ("categorical_accuracy", LOGITS, ONEHOT), ("sparse_top_k_categorical_accuracy",
                                              torch.randn(N, 6, generator=g), CLASSES),
    ("mae", REG, REG_T), ("mse", REG, REG_T), ("auc", BIN_LOGITS, BIN),
    ("precision", BIN_LOGITS, BIN), ("recall", BIN_LOGITS, BIN),
])
@pytest.mark.parametrize("weighted", [False, True])
def test_keras_metric_names_match_keras_on_two_devices(
        keras: Any, name: str, outputs: torch.Tensor, targets: torch.Tensor,
        weighted: bool) -> None:
    """metrics=['accuracy'] (and the other Keras names) were refused; now, per device slice
    with uneven loads, each equals Keras's metric on the whole data."""
    if weighted and name in ("auc", "precision", "recall"):
        with pytest.raises(ValueError, match="weighted_metrics"):
            metric_specs(None, [name])
        return
    specs = metric_specs(None if weighted else [name], [name] if weighted else None)
    dm = DeviceMetrics(specs, CPU2)
    cut = 13  # uneven work loads
    for d, rows in enumerate((slice(0, cut), slice(cut, N))):
        dm.update(d, outputs[rows], targets[rows], WEIGHTS[rows] if weighted else None)
    got = dm.compute()[name]
    want = _keras_metric(keras, name, outputs, targets, WEIGHTS if weighted else None)
    # Keras's AUC sums over 200 thresholds; torchmetrics' is exact.
    np.testing.assert_allclose(got, want, atol=1e-2 if name == "auc" else 1e-6)


def test_fit_with_keras_names_matches_the_keras_twin(keras: Any) -> None:
    """compile(loss='sparse_categorical_crossentropy', metrics=['accuracy'],
    weighted_metrics=['accuracy']) trains and logs as Keras does, log keys included."""
    x, y, w = twins.data(32)
    model = twins.fitdp_model(metrics=False)
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"],
                  weighted_metrics=["accuracy"], lr=0.1)
    ours = model.fit(x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0,
                     devices=["cpu", "cpu"], work_load_list=[1, 3])
    twin = twins.keras_model(keras)
    twin.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                 weighted_metrics=["accuracy"],
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    theirs = twin.fit(*twins.np_(x, y), sample_weight=w.numpy(), batch_size=8, epochs=2,
                      shuffle=False, verbose=0)
    assert set(theirs.history) <= set(ours.history) | {"learning_rate"}
    twins.close(ours.history, theirs.history, ["loss", "accuracy", "weighted_accuracy"])
    assert twins.same_weights(model, twin, atol=1e-5)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_adam_name_is_torchs_adam_whose_epsilon_differs_from_keras(keras: Any) -> None:
    """compile("adam") is torch.optim.Adam with torch's defaults (eps=1e-8 added to the
    bias-corrected sqrt(v_hat)), not Keras's Adam (epsilon=1e-7 added to sqrt(v) before the
    bias correction, keras/src/optimizers/adam.py ``update_step``): docs/keras-lightning.md's
    differences table says so. With gradients near epsilon (inputs scaled by 1e-6) fitdp
    trains as a hand-written torch Adam loop and visibly not as the Keras twin."""
    x, y, _ = twins.data(16)
    x = x * 1e-6
    model = twins.fitdp_model(metrics=False)
    model.compile("adam", "cross_entropy", lr=0.1)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, devices=["cpu"])
    assert model.optimizers["0"].defaults["eps"] == 1e-8
    ref = twins.linear()
    opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for _ in range(2):
        for sl in (slice(0, 8), slice(8, 16)):
            opt.zero_grad()
            F.cross_entropy(ref(x[sl]), y[sl]).backward()
            opt.step()
    torch.testing.assert_close(dict(model.module.named_parameters()),
                               dict(ref.named_parameters()))
    twin = twins.keras_model(keras, metrics=False)
    assert keras.optimizers.Adam().epsilon == 1e-7
    twin.compile(optimizer=keras.optimizers.Adam(0.1),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    twin.fit(*twins.np_(x, y), batch_size=8, epochs=2, shuffle=False, verbose=0)
    ours, theirs = model.get_weights()["weight"], twins.keras_weights(twin)[0]
    assert float((ours - torch.from_numpy(theirs)).abs().max()) > 0.1
    page = (Path(__file__).parents[2] / "docs" / "keras-lightning.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith('| `"adam"`'))
    assert "1e-7" in row and "1e-8" in row and "torch.optim.Adam" in row
