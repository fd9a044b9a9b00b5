"""The CUDA tier, stream ordering. Each replica runs on its device's current stream (the
caller's; two replicas on one GPU share it) from a thread of its own; what it reads from the
caller (weights just stepped or broadcast, gradients just zeroed, inputs just made) and what
the caller reads from it (outputs, losses, metric states) must be ordered by the streams and
the threads' hand-offs, not by timing luck. Keeping one stream busy with
``torch.cuda._sleep`` (a spin kernel, torch's own tool for such tests) makes a missing
ordering show every time instead of once in a while."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import CUDA, DEVICE_LISTS, PoolNet, _bce, _sequences, data, hand_loop, mlp
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError

import fitdp
from fitdp.callbacks import Callback

pytestmark = pytest.mark.requires_cuda
DEVICES = list(DEVICE_LISTS.values())
IDS = list(DEVICE_LISTS)
SLEEP = 50_000_000  # GPU clock cycles (~25 ms): far longer than the host's work per batch


class SlowForward(nn.Module):
    """``inner``, behind a spin kernel on the stream it runs on: its outputs come late."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP)
        return self.inner(x)


class BusyCallerStream(Callback):
    """Keeps the caller's stream busy at the start of every batch: whatever fitdp queues
    there during the batch (zeroing gradients, the optimizer step, the broadcast of the
    weights) runs long after the Python calls return."""

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        torch.cuda._sleep(SLEEP)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_predict_reads_outputs_after_the_replicas_streams(devices: list[str]) -> None:
    x, _ = data(45)
    net = mlp()
    with torch.no_grad():
        expected = net(x)
    preds = fitdp.Model(SlowForward(net)).predict(x, batch_size=16, devices=devices)
    torch.testing.assert_close(preds, expected, rtol=1e-4, atol=1e-5)


def accuracy() -> MulticlassAccuracy:
    """Without argument checks: those read values on the host, which would wait for the
    replica's stream and hide a missing ordering behind an accidental one."""
    return MulticlassAccuracy(num_classes=5, average="micro", validate_args=False)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_evaluate_reads_losses_and_metrics_after_the_replicas_streams(
        devices: list[str]) -> None:
    x, y = data(45)
    net = mlp()
    with torch.no_grad():
        out = net(x)
    expected = {"loss": float(F.cross_entropy(out, y)), "acc": float(accuracy()(out, y))}
    model = fitdp.Model(SlowForward(net))
    model.compile(optimizer="sgd", loss="cross_entropy", metrics={"acc": accuracy()})
    logs = model.evaluate(x, y, batch_size=16, devices=devices, verbose=0)
    assert logs == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_bucketed_evaluate_orders_the_buckets_streams(devices: list[str]) -> None:
    """Every bucket's executor on a device shares that device's input buffers: the next
    bucket's batch must not be written into them while the previous one is still read."""
    seqs, y = _sequences()
    torch.manual_seed(0)
    net = PoolNet()
    total, reference = 0.0, MeanSquaredError()
    with torch.no_grad():
        for batch in fitdp.BucketIterator(seqs, y, batch_size=16, buckets=[8, 20],
                                          shuffle=False):
            out = net(batch.data)
            total += float(_bce(out, batch.label)) * len(out)
            reference.update(out, batch.label.float())
    model = fitdp.Model(SlowForward(net), bucket_module=lambda key: SlowForward(PoolNet()))
    model.compile(optimizer="sgd", loss=_bce, metrics={"mse": MeanSquaredError()})
    it = fitdp.BucketIterator(seqs, y, batch_size=16, buckets=[8, 20], seed=0)
    logs = model.evaluate(it, devices=devices, verbose=0)
    expected = {"loss": total / len(seqs), "mse": float(reference.compute())}
    assert logs == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_training_waits_for_the_callers_stream(devices: list[str]) -> None:
    """The inputs are made on a busy stream right before fit (the module already on the GPU:
    no upload from the host drains that stream first), and every batch starts with the
    caller's stream busy: the replicas must still see each input and each step's weights."""
    x, y = data(100)
    ref = hand_loop(mlp().to(CUDA), torch.optim.SGD, x.to(CUDA), y.to(CUDA), steps=10,
                    bs=10, lr=0.1, momentum=0.9)
    net, x_dev, y_dev = mlp().to(CUDA), x.to(CUDA), y.to(CUDA)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    x_late = x_dev * 1.0  # queued behind the spin kernel: written ~25 ms from now
    model = fitdp.Model(net)
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                  loss="cross_entropy")
    model.fit(x_late, y_dev, batch_size=10, devices=devices, shuffle=False,
              callbacks=[BusyCallerStream()], verbose=0)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
