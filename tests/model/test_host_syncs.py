"""What fitdp chooses so that a CUDA step needs no host sync between log points (the CPU
half; tests/cuda/test_cuda_syncs.py counts the syncs on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import fitdp
from fitdp.data.sources import make_source
from fitdp.executor.devices import pin_host_batches


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_16_mixed_builds_the_fused_optimizer(name):
    # GradScaler.step reads its found-inf flag on the host (.item()) every step unless the
    # optimizer is fused: fitdp's named optimizers were built unfused under 16-mixed.
    model = fitdp.Model(nn.Linear(3, 2))
    model.compile(optimizer=name, loss="mse", precision="16-mixed")
    assert model.optimizer is not None and model.optimizer.defaults["fused"] is True
    assert getattr(model.optimizer, "_step_supports_amp_scaling", False)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_other_precisions_and_rmsprop_keep_torchs_default(precision):
    model = fitdp.Model(nn.Linear(3, 2))
    model.compile(optimizer="adam", loss="mse", precision=precision)
    assert model.optimizer is not None and not model.optimizer.defaults["fused"]
    rms = fitdp.Model(nn.Linear(3, 2))
    rms.compile(optimizer="rmsprop", loss="mse", precision="16-mixed")  # torch has no fused one
    assert rms.optimizer is not None and "fused" not in rms.optimizer.defaults


def test_host_batches_are_pinned_only_for_cuda_devices():
    assert pin_host_batches([torch.device("cuda", 0), torch.device("cuda", 0)])
    assert not pin_host_batches([torch.device("cpu")])
    assert not pin_host_batches([torch.device("cpu"), torch.device("cuda", 0)])


@pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true")
def test_the_loader_made_for_a_dataset_pins_when_asked():
    # Pageable host batches were copied with non_blocking=True (the driver stages them).
    data = TensorDataset(torch.zeros(8, 3), torch.zeros(8))
    pinned = make_source(data, batch_size=4, shuffle=False, seed=0, pin_memory=True)
    plain = make_source(data, batch_size=4, shuffle=False, seed=0)
    assert pinned.loader.pin_memory and not plain.loader.pin_memory  # type: ignore[attr-defined]
