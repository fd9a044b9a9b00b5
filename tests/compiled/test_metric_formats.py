"""Metrics equal one device's whatever the device count and work loads, for every
torchmetrics input format (issue 17.2) and state kind, mergeable or not (issue 17.4)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torchmetrics import MeanSquaredError, Metric
from torchmetrics import classification as C
from torchmetrics.regression import PearsonCorrCoef

import fitdp


class Passthrough(nn.Module):
    """Outputs its input (times a weight of 1: exact), so the metric sees chosen scores."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _zero_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.float().mean() * 0.0


# format -> (scores of n rows, targets of n rows, metrics); logits or probabilities.
def _binary(g: torch.Generator, n: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.randn(n, generator=g) * 3
    return (s if logits else s.sigmoid()), torch.randint(0, 2, (n,), generator=g)


def _multiclass(g: torch.Generator, n: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.randn(n, 3, generator=g) * 3
    return (s if logits else s.softmax(1)), torch.randint(0, 3, (n,), generator=g)


def _multilabel(g: torch.Generator, n: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.randn(n, 2, generator=g) * 3
    return (s if logits else s.sigmoid()), torch.randint(0, 2, (n, 2), generator=g)


def _regression(g: torch.Generator, n: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


FORMATS: dict[str, tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                         list[Callable[[], Metric]]]] = {
    "binary": (_binary, [C.BinaryAccuracy, C.BinaryAUROC, C.BinaryF1Score,
                         C.BinaryCalibrationError]),
    "multiclass": (_multiclass, [lambda: C.MulticlassAccuracy(3, average="micro"),
                                 lambda: C.MulticlassAUROC(3),
                                 lambda: C.MulticlassCalibrationError(3)]),
    "multilabel": (_multilabel, [lambda: C.MultilabelAccuracy(2),
                                 lambda: C.MultilabelAUROC(2)]),
    "regression": (_regression, [MeanSquaredError, PearsonCorrCoef]),
}


def _one_device(makes: list[Callable[[], Metric]], x: torch.Tensor, y: torch.Tensor,
                batch: int) -> list[float]:
    """torchmetrics updated batch by batch on one device: the reference."""
    refs = [make() for make in makes]
    for start in range(0, len(x), batch):
        for ref in refs:
            ref.update(x[start:start + batch], y[start:start + batch])
    return [float(ref.compute()) for ref in refs]


def _evaluate(makes: list[Callable[[], Metric]], x: torch.Tensor, y: torch.Tensor,
              batch: int, devices: list[str], loads: list[int] | None) -> list[float]:
    model = fitdp.Model(Passthrough())
    model.compile("sgd", loss=_zero_loss, metrics={str(i): m() for i, m in enumerate(makes)})
    logs = model.evaluate(x, y, batch_size=batch, devices=devices, work_load_list=loads,
                          verbose=0)
    return [logs[str(i)] for i in range(len(makes))]


def test_binary_logits_on_two_devices_read_as_one_device_reads_them() -> None:
    """Regression (issue 17.2): 8 logits of 0.3 and 8 of +-3, targets 1: BinaryAccuracy read
    0.75 on ["cpu"] and 0.25 on ["cpu", "cpu"] (a slice of 0.3s was read as probabilities)."""
    x = torch.cat([torch.full((8,), 0.3), torch.tensor([3.0, -3.0] * 4)])
    y = torch.ones(16, dtype=torch.long)
    for devices in (["cpu"], ["cpu", "cpu"]):
        assert _evaluate([C.BinaryAccuracy], x, y, 16, devices, None) == [0.75]


def test_pearson_trains_on_several_devices() -> None:
    """Regression (issue 17.4): PearsonCorrCoef (full_state_update=True, merge_state refuses)
    was refused on several devices; it equals the one-device value."""
    g = torch.Generator().manual_seed(3)
    x, y = _regression(g, 40, False)
    one = _evaluate([PearsonCorrCoef], x, y, 16, ["cpu"], None)
    assert _evaluate([PearsonCorrCoef], x, y, 16, ["cpu", "cpu"], [1, 3]) == one


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(sorted(FORMATS)), logits=st.booleans(), n=st.integers(1, 3),
       loads=st.lists(st.integers(1, 5), min_size=3, max_size=3), rows=st.integers(6, 40),
       batch=st.integers(3, 16), seed=st.integers(0, 2**16))
def test_every_format_equals_one_device(fmt: str, logits: bool, n: int, loads: list[int],
                                        rows: int, batch: int, seed: int) -> None:
    """Property (issues 17.2, 17.4): for 1-3 CPU replicas with random work loads, every input
    format (binary, multiclass, multilabel, regression; logits or probabilities) and state
    kind (sums, 'cat' lists, full_state_update) gives torchmetrics' one-device value."""
    make_data, makes = FORMATS[fmt]
    x, y = make_data(torch.Generator().manual_seed(seed), rows, logits)
    if logits and fmt != "regression":  # some slices of logits lie inside [0, 1]
        x[: rows // 2] = x[: rows // 2].sigmoid()
    got = _evaluate(makes, x, y, batch, ["cpu"] * n, loads[:n])
    assert got == pytest.approx(_one_device(makes, x, y, batch), rel=1e-6, abs=1e-7, nan_ok=True)
