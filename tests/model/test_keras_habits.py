"""What Keras users write on metrics and losses: names, metrics per output, weighted metrics,
monitoring what the progress bar shows, and probabilities refused where logits are meant."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError

import fitdp
from fitdp.callbacks import EarlyStopping
from fitdp.compiled.metrics import metric_specs


class TwoHeads(nn.Module):
    """A classifier and a box regressor on one trunk, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.cls, self.box = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return {"cls": self.cls(h), "box": self.box(h)}


def _data(n: int = 37) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), {"cls": torch.randint(0, 3, (n,), generator=g),
                                             "box": torch.randn(n, 2, generator=g)}


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_metrics_per_output_equal_torchmetrics_on_the_whole_data(devices: list[str]) -> None:
    """A dict of lists of torchmetrics metrics on dict outputs failed; now each reads its
    output, under Keras's log keys, equal to the metric on the whole data on any work loads."""
    x, y = _data()
    model = fitdp.Model(TwoHeads())
    model.compile("sgd", {"cls": "sparse_categorical_crossentropy", "box": "mse"}, lr=0.0,
                  metrics={"cls": [MulticlassAccuracy(num_classes=3), "accuracy"],
                           "box": [MeanAbsoluteError()]})
    loads = [1, 3] if len(devices) == 2 else None
    logs = model.evaluate(x, y, batch_size=10, devices=devices, work_load_list=loads,
                          verbose=0)
    with torch.no_grad():
        out = model.module(x)
    assert set(logs) == {"loss", "cls_multiclass_accuracy", "cls_accuracy",
                         "box_mean_absolute_error"}
    want_acc = MulticlassAccuracy(num_classes=3, average="micro")(out["cls"], y["cls"])
    assert logs["cls_accuracy"] == pytest.approx(float(want_acc), abs=1e-7)
    assert logs["cls_multiclass_accuracy"] == pytest.approx(float(MulticlassAccuracy(
        num_classes=3)(out["cls"], y["cls"])), abs=1e-7)
    assert logs["box_mean_absolute_error"] == pytest.approx(float(
        (out["box"] - y["box"]).abs().mean()), rel=1e-6)


def test_weighted_metrics_per_output_on_two_devices_equal_the_weighted_mean() -> None:
    """weighted_metrics did not exist; per output with sample weights on two devices they
    are Keras's weighted means, and a name taken by metrics gets 'weighted_' before it."""
    x, y = _data()
    w = torch.rand(len(x), generator=torch.Generator().manual_seed(2)) + 0.5
    model = fitdp.Model(TwoHeads())
    model.compile("sgd", {"cls": "cross_entropy", "box": "mae"}, lr=0.0,
                  metrics={"cls": ["accuracy"]}, weighted_metrics={"cls": ["accuracy"],
                                                                   "box": ["mae"]})
    logs = model.evaluate(x, y, sample_weight=w, batch_size=16, devices=["cpu", "cpu"],
                          work_load_list=[2, 1], verbose=0)
    with torch.no_grad():
        out = model.module(x)
    right = (out["cls"].argmax(1) == y["cls"]).float()
    assert logs["cls_accuracy"] == pytest.approx(float(right.mean()))
    assert logs["cls_weighted_accuracy"] == pytest.approx(float((right * w).sum() / w.sum()))
    per = (out["box"] - y["box"]).abs().mean(1)
    assert logs["box_mae"] == pytest.approx(float((per * w).sum() / w.sum()), rel=1e-6)


def test_softmax_outputs_are_refused_for_a_logits_loss_before_any_step() -> None:
    """A module ending in softmax trained silently on a double softmax; now the first batch
    is refused, naming the fix, and the weights have not moved."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    before = [p.detach().clone() for p in net.parameters()]
    model = fitdp.Model(net)
    model.compile("sgd", "sparse_categorical_crossentropy", lr=0.5)
    x, y = _data(16)
    with pytest.raises(ValueError, match="logits.*from_logits=True"):
        model.fit(x, y["cls"], batch_size=8, verbose=0, devices=["cpu", "cpu"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))


def test_early_stopping_monitors_the_name_the_progress_bar_shows() -> None:
    """EarlyStopping(monitor='val_acc') warned every epoch and never stopped while the screen
    showed val_acc for val_multiclass_accuracy; now it watches that key and stops."""
    torch.manual_seed(0)
    x, y = _data(32)
    model = fitdp.Model(nn.Linear(4, 3))
    model.compile("sgd", "cross_entropy", lr=0.0, metrics=[MulticlassAccuracy(num_classes=3)])
    stop = EarlyStopping(monitor="val_acc", patience=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "not in the logs" would fail
        history = model.fit(x, y["cls"], validation_data=(x, y["cls"]), epochs=6, verbose=0,
                            callbacks=[stop], devices=["cpu"])
    assert len(history.epoch) == 2  # lr 0: no improvement after the first epoch
    assert stop.mode == "max"


@pytest.mark.parametrize(("metrics", "weighted", "error", "match"), [
    (["accuracyy"], None, ValueError, "unknown metric name 'accuracyy'"),
    ("accuracy", None, TypeError, r"metrics=\['accuracy'\]"),
    (None, ["auc"], ValueError, "cannot take sample weights"),
    (None, [MeanAbsoluteError()], TypeError, "takes no sample weights"),
    ({"cls": ["accuracy"], "acc": "accuracy"}, None, TypeError, "mixes lists and metrics"),
    (["accuracy", "accuracy"], None, ValueError, "share the log key 'accuracy'"),
])
def test_bad_metric_arguments_name_the_fix(metrics: object, weighted: object,
                                           error: type[Exception], match: str) -> None:
    """Wrong metric names and forms are refused at compile with the fix."""
    with pytest.raises(error, match=match):
        metric_specs(metrics, weighted)


def test_unknown_loss_name_lists_keras_names_too() -> None:
    """The loss-name error now lists Keras's names with fitdp's."""
    model = fitdp.Model(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="sparse_categorical_crossentropy"):
        model.compile("sgd", "sparse_crossentropy")
