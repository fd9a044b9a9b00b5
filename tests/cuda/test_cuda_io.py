"""The CUDA tier, what comes out of a GPU run: predictions in input order, checkpoints that
resume bit for bit, and exports that need no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_helpers import (
    BATCH,
    CUDA,
    DEVICE_LISTS,
    EPOCHS,
    Crash,
    PoolNet,
    X,
    Y,
    _sequences,
    assert_bitwise,
    data,
    mlp,
)
from torch import nn

import fitdp
from fitdp.callbacks import Callback, ModelCheckpoint

pytestmark = pytest.mark.requires_cuda
DEVICES = list(DEVICE_LISTS.values())
IDS = list(DEVICE_LISTS)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_predict_rows_in_order_on_cuda(devices: list[str]) -> None:
    """API.md: predict returns exactly one row per input sample, in input order, on the CPU
    (203 rows: a short last batch; outputs are copied to the host right after the replicas'
    forwards in their own threads)."""
    x, _ = data(203)
    net = mlp()
    with torch.no_grad():
        expected = net(x)
    preds = fitdp.Model(net).predict(x, batch_size=16, devices=devices)
    assert preds.device.type == "cpu" and preds.shape == (203, 5)
    torch.testing.assert_close(preds, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_predict_buckets_in_input_order_on_cuda(devices: list[str]) -> None:
    """A shuffled BucketIterator's rows come back by their sample index (MXNet's bucketing
    reorders samples; fitdp's predict gives them back in input order)."""
    seqs, _ = _sequences()
    torch.manual_seed(0)
    net = PoolNet()
    expected = torch.empty(len(seqs))
    with torch.no_grad():  # the same padded widths, one bucket batch at a time, on the CPU
        for batch in fitdp.BucketIterator(seqs, None, batch_size=16, buckets=[8, 20],
                                          shuffle=False):
            expected[batch.index] = net(batch.data)
    it = fitdp.BucketIterator(seqs, None, batch_size=16, buckets=[8, 20], seed=3)
    model = fitdp.Model(net, bucket_module=lambda key: PoolNet())
    preds = model.predict(it, devices=devices)
    torch.testing.assert_close(preds, expected, rtol=1e-4, atol=1e-5)


def make(precision: str) -> fitdp.Model:
    """tests/model/test_resume.py's model (dropout: CUDA random numbers), in ``precision``."""
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3),
                                      nn.Linear(16, 3)))
    model.compile("adamw", lr=0.01, precision=precision,
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    return model


def train(model: fitdp.Model, devices: list[str], callbacks: list[Callback],
          resume: str | None = None) -> None:
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0, devices=devices,
              callbacks=callbacks, resume=resume)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_resume_bitwise_on_cuda(tmp_path: Path, devices: list[str], precision: str) -> None:
    """Issue 10.6: a seeded run is reproducible bit for bit on any device list and resumes
    bitwise. A run killed after step 10 (mid-epoch 1) and resumed from its last checkpoint
    ends with the weights of an uninterrupted run: CUDA generator states (dropout), the
    optimizer, the scheduler and the 16-mixed GradScaler all come back."""
    reference = make(precision)
    train(reference, devices, [])
    again = make(precision)
    train(again, devices, [])
    assert_bitwise(again, reference)  # the seed alone reproduces the run
    pattern = str(tmp_path / "c-{step:03d}.ckpt")
    crashed = make(precision)
    with pytest.raises(KeyboardInterrupt):
        train(crashed, devices, [ModelCheckpoint(pattern, save_freq=1, monitor="loss"),
                                 Crash(10)])
    resumed = make(precision)
    train(resumed, devices, [ModelCheckpoint(pattern, save_freq=1, monitor="loss")],
          resume="latest")
    assert resumed.global_step == EPOCHS * 7
    assert_bitwise(resumed, reference)


def test_checkpoint_from_cuda_loads_without_a_gpu(tmp_path: Path) -> None:
    """API.md: a checkpoint "loads with torch.load(weights_only=True)", and it holds the host
    weights: a file written on a GPU must load where there is none, so it holds no CUDA
    tensors (Adam's moments included); ``load`` puts it into a model on the CPU."""
    trained = make("32")
    train(trained, [CUDA], [])
    trained.save(tmp_path / "gpu.ckpt")
    state = torch.load(tmp_path / "gpu.ckpt", weights_only=True)

    def cuda_tensors(value: object, where: str) -> list[str]:
        if isinstance(value, torch.Tensor):
            return [where] if value.is_cuda else []
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, (list, tuple)) else ()
        return [w for k, v in items for w in cuda_tensors(v, f"{where}[{k!r}]")]

    assert cuda_tensors(state, "checkpoint") == []
    on_cpu = make("32")
    on_cpu.load(tmp_path / "gpu.ckpt")
    assert_bitwise(on_cpu, trained)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_export_from_cuda_training(tmp_path: Path, devices: list[str]) -> None:
    """Caffe2's ExtractPredictorNet: one device's worth of the averaged weights, in eval mode;
    from a CUDA run (CUDA example inputs) the predictor runs on the CPU like predict."""
    x, y = data(96)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                        nn.Linear(32, 5))
    model = fitdp.Model(net)
    model.compile(optimizer="adam", lr=0.01, loss="cross_entropy")
    model.fit(x, y, batch_size=16, epochs=2, devices=devices, verbose=0)
    model.export(tmp_path / "net.pt2", x[:4].to(CUDA))
    predictor = fitdp.load_predictor(tmp_path / "net.pt2")
    expected = model.predict(x[:37], batch_size=16, devices=devices)
    torch.testing.assert_close(predictor(x[:37]), expected, rtol=1e-4, atol=1e-5)
    assert net.training and next(net.parameters()).device.type == "cpu"
