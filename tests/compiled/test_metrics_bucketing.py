"""Metrics end to end through Model: bucketed data and several replicas give the numbers a
DataLoader gives, and an unmergeable metric is refused before any weight moves."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

import fitdp


class Oracle(nn.Module):
    """Ranks every sequence right: logit +5 when its first token is odd (the label), else -5,
    plus one trained shift shared by every row, so the ranking stays perfect while it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, 0] % 2).float() * 10 - 5 + self.shift


def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(out, y.float())


def _data(n: int = 240) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 50, (int(k),), generator=g) for k in torch.randint(2, 30, (n,),
                                                                               generator=g)]
    return seqs, torch.tensor([int(s[0]) % 2 for s in seqs])


def _oracle(bucketed: bool) -> fitdp.Model:
    model = fitdp.Model(Oracle(), bucket_module=(lambda key: Oracle()) if bucketed else None)
    model.compile(optimizer="sgd", loss=_bce, metrics=[BinaryAUROC()], lr=0.01)
    return model


@pytest.mark.parametrize("bucketed", [False, True])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_auroc_of_a_perfect_model_with_bucket_iterator(devices: list[str], bucketed: bool) -> None:
    """Regression (issue 10.1): a model whose predictions are 100% right read AUROC 0.50
    (train) and 0.63 (val) with a BucketIterator, because the metric kept views of reused
    label buffers; through a DataLoader it read 1.0."""
    seqs, labels = _data()
    train = fitdp.BucketIterator(seqs, labels, batch_size=16, seed=0)
    val = fitdp.BucketIterator(seqs, labels, batch_size=16, shuffle=False)
    history = _oracle(bucketed).fit(train, validation_data=val, epochs=2, devices=devices,
                                    verbose=0).history
    assert history["binary_auroc"] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert history["val_binary_auroc"] == pytest.approx([1.0, 1.0], abs=1e-6)


def test_auroc_of_a_perfect_model_through_a_dataloader() -> None:
    """The reference of the regression above: the same model and data through a DataLoader."""
    seqs, labels = _data()
    padded = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    loader = DataLoader(TensorDataset(padded, labels), batch_size=16)
    history = _oracle(False).fit(loader, validation_data=loader, devices=["cpu", "cpu"],
                                 verbose=0).history
    assert history["binary_auroc"] == pytest.approx([1.0], abs=1e-6)
    assert history["val_binary_auroc"] == pytest.approx([1.0], abs=1e-6)


def test_cat_metric_on_outputs_with_autograd_history_several_replicas() -> None:
    """Regression (issue 10.1): BinaryAUROC on probabilities (kept as given, with their
    autograd history) crashed training on several replicas with "Only Tensors created
    explicitly by the user (graph leaves) support the deepcopy protocol"."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0), nn.Sigmoid()))
    model.compile(optimizer="sgd", metrics=[BinaryAUROC()],
                  loss=lambda p, t: F.binary_cross_entropy(p, t.float()))
    history = model.fit(x, y, batch_size=16, epochs=2, devices=["cpu", "cpu"],
                        validation_data=(x, y), verbose=0).history
    assert len(history["binary_auroc"]) == 2
    logs = model.evaluate(x, y, batch_size=16, devices=["cpu", "cpu", "cpu"], verbose=0)
    reference = BinaryAUROC()(model.predict(x, batch_size=16), y)
    assert logs["binary_auroc"] == pytest.approx(float(reference))
