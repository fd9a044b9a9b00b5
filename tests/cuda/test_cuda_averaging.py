"""The CUDA tier, EMA and SWA: on one GPU and on two replicas of it, the average equals
``AveragedModel``'s in a hand-written CUDA loop, and keeping it costs no host sync."""

from __future__ import annotations

import copy

import cuda_helpers  # noqa: F401 - first: it puts tests/callbacks on the path
import pytest
from averaging_helpers import BATCH, X, Y, assert_params, hand_loop, model, net
from cuda_helpers import CUDA, DEVICE_LISTS, SyncCounter, learnable, mlp
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fitdp
from fitdp.callbacks import EMA, SWA

pytestmark = pytest.mark.requires_cuda
DEVICES = list(DEVICE_LISTS.values())
IDS = list(DEVICE_LISTS)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_ema_on_cuda_equals_averaged_model_of_a_cuda_hand_loop(devices: list[str]) -> None:
    module = net()
    m = model(module)
    m.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, devices=devices,
          callbacks=[EMA(decay=0.9)])
    trained = copy.deepcopy(module).to(CUDA)
    averaged = AveragedModel(trained, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    hand_loop(trained, 3, averaged, device=CUDA)
    assert_params(m.get_weights(), averaged, exact=False)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_swa_on_cuda_equals_averaged_model_of_a_cuda_hand_loop(devices: list[str]) -> None:
    """AveragedModel's CUDA path (the foreach SWA average, n_averaged on the device)."""
    module = net()
    m = model(module)
    m.fit(X, Y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, devices=devices,
          callbacks=[SWA(swa_lr=0.1, swa_epoch_start=1, annealing_epochs=0)])
    trained = copy.deepcopy(module).to(CUDA)
    averaged = AveragedModel(trained)
    hand_loop(trained, 4, averaged, epoch_end=lambda e: averaged.update_parameters(trained)
              if e >= 1 else None, after_step=False, device=CUDA)
    assert_params(m.get_weights(), averaged, exact=False)


def test_ema_adds_no_host_sync_between_log_points() -> None:
    """The average is updated on the GPU from the replica's parameters: no copy to the host
    and no sync in the batches that are not log points (the EMA hook runs inside the
    counter's window, listed after it)."""
    x, y = learnable(30 * 16, 12, 5)
    m = fitdp.Model(mlp())
    m.compile(optimizer="adam", lr=0.01, loss="cross_entropy")
    counter = SyncCounter(log_every=10)
    try:
        m.fit(x.to(CUDA), y.to(CUDA), batch_size=16, devices=[CUDA], log_every=10,
              callbacks=[counter, EMA()], verbose=0)
    finally:
        counter.close()
    assert counter.windows == 26
    assert counter.syncs == [], f"host syncs by line: {counter.where()}"
