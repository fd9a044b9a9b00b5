"""The CUDA tier, metrics: every torchmetrics state kind, fed from device buffers that every
bucket reuses, equals the metric computed once over the whole epoch."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE_LISTS, KINDS, PoolNet, _bce, _sequences

import fitdp

pytestmark = pytest.mark.requires_cuda


@pytest.mark.parametrize("devices", list(DEVICE_LISTS.values()), ids=list(DEVICE_LISTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_state_kind_through_fit_and_evaluate(kind: str, devices: list[str]) -> None:
    """Regression (issue 10.1), on CUDA and through Model: 'cat' metrics kept views of label
    buffers the next batch overwrote. torchmetrics reduces each state by its own rule (sum,
    mean, cat, min, max, a callable); with lr=0 the weights stay put, so the training epoch
    (labels staged in reused device buffers, outputs with autograd history, metric updates on
    the replicas' threads) and evaluate must both give the metric of the whole epoch at
    once."""
    seqs, y = _sequences()
    it = fitdp.BucketIterator(seqs, y, batch_size=16, buckets=[8, 20], seed=0)
    torch.manual_seed(0)
    net = PoolNet()
    reference = KINDS[kind]()
    with torch.no_grad():  # PoolNet pools over the padding: the same padded batches, on CPU
        for batch in fitdp.BucketIterator(seqs, y, batch_size=16, buckets=[8, 20],
                                          shuffle=False):
            reference.update(net(batch.data), batch.label)
    expected = float(reference.compute())
    model = fitdp.Model(net, bucket_module=lambda key: PoolNet())
    model.compile(optimizer="sgd", lr=0.0, loss=_bce, metrics={"m": KINDS[kind]()})
    history = model.fit(it, devices=devices, verbose=0)
    assert history.history["m"][0] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    logs = model.evaluate(it, devices=devices, verbose=0)
    assert isinstance(logs, dict) and logs["m"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
