"""The CUDA tier, what reading fitdp's CUDA paths against PyTorch's semantics found (issue
21): weights read on the host only after they land, replica threads on the caller's device
and stream, no host sync from fitdp's own choices, pinned host batches, CUDA graphs from
replica threads. Written against public behaviour: they hold whatever the executor's
internals are."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import CUDA, DEVICE_LISTS, data, hand_loop, mlp
from torch import nn

import fitdp
from fitdp.callbacks import Callback
from fitdp.data.sources import make_source
from fitdp.executor.devices import pin_host_batches

pytestmark = pytest.mark.requires_cuda
DEVICES = list(DEVICE_LISTS.values())
IDS = list(DEVICE_LISTS)
SLEEP = 50_000_000  # GPU clock cycles (~25 ms): far longer than the host's work per batch


class SleepBeforeEveryStep(Callback):
    """A spin kernel on the caller's stream at each batch's start: the step's weights land
    ~25 ms after the Python calls that queued them return."""

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        torch.cuda._sleep(SLEEP)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_get_weights_right_after_a_sleep_equals_the_replicas_weights(devices: list[str]
                                                                     ) -> None:
    """copy_to copied each replica to the host with non_blocking=True and averaged at once:
    with the last step still queued behind a spin kernel, the host read stale or torn
    weights. The host module and get_weights() must hold the trained weights."""
    x, y = data(100)
    ref = hand_loop(mlp().to(CUDA), torch.optim.SGD, x.to(CUDA), y.to(CUDA), steps=10,
                    bs=10, lr=0.1, momentum=0.9)
    model = fitdp.Model(mlp())  # on the host: get_weights copies device -> host
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                  loss="cross_entropy")
    model.fit(x.to(CUDA), y.to(CUDA), batch_size=10, devices=devices, shuffle=False,
              callbacks=[SleepBeforeEveryStep()], verbose=0)
    torch.cuda._sleep(SLEEP)  # and once more, right before reading
    got = model.get_weights()
    for (name, q) in ref.named_parameters():
        torch.testing.assert_close(got[name], q.detach().cpu(), rtol=1e-4, atol=1e-5,
                                   msg=name)


SEEN: list[tuple[int, int, torch.device]] = []  # shared by every copy of WhereAmI


class WhereAmI(nn.Module):
    """``inner``, recording in ``SEEN`` the current device and stream its forward runs on
    (every replica's copy alike), and making a tensor with ``device="cuda"`` (the current
    device) as user code does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros((), device="cuda")
        SEEN.append((torch.cuda.current_device(), torch.cuda.current_stream().stream_id,
                     bias.device))
        return self.inner(x) + bias


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_replicas_run_on_their_device_and_the_callers_stream(devices: list[str]) -> None:
    """The current device and stream are per thread: replica threads that never entered
    them ran on cuda:0's default stream, unordered against a caller's torch.cuda.stream(s),
    and device="cuda" inside forward landed on cuda:0 whatever the replica's device."""
    x, y = data(60)
    SEEN.clear()
    model = fitdp.Model(WhereAmI(mlp()))
    model.compile(optimizer="sgd", loss="cross_entropy")
    stream = torch.cuda.Stream(CUDA)
    with torch.cuda.stream(stream):
        model.fit(x.to(CUDA), y.to(CUDA), batch_size=10, devices=devices, verbose=0)
    stream.synchronize()
    assert SEEN, "no forward was recorded"
    index = torch.device(devices[0]).index or 0
    assert {(dev, sid) for dev, sid, _ in SEEN} == {(index, stream.stream_id)}
    assert {d for _, _, d in SEEN} == {torch.device("cuda", index)}


def test_shuffled_host_batches_for_cuda_devices_are_pinned() -> None:
    """Pageable host batches were copied with non_blocking=True (staged by the driver)."""
    x, y = data(40)
    pin = pin_host_batches([torch.device(CUDA)])
    pinned = list(make_source(x, y, batch_size=16, shuffle=True, seed=3, pin_memory=pin))
    plain = list(make_source(x, y, batch_size=16, shuffle=True, seed=3))
    assert pin and all(b.data.is_pinned() and b.label.is_pinned() for b in pinned)
    for a, b in zip(pinned, plain):
        assert torch.equal(a.data, b.data) and torch.equal(a.label, b.label)


@pytest.mark.parametrize("devices", DEVICES, ids=IDS)
def test_reduce_overhead_trains_from_replica_threads(devices: list[str]) -> None:
    """CUDA graphs (compile="reduce-overhead") made on replica threads: training runs and
    ends with the weights eager training gives (two replicas on one GPU: each thread's
    graphs compiled and recorded apart)."""
    x, y = data(100)
    weights = []
    for compile in (False, "reduce-overhead"):
        torch.manual_seed(0)
        model = fitdp.Model(mlp())
        model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy", compile=compile)
        model.fit(x, y, batch_size=10, epochs=2, devices=devices, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-3, atol=1e-4, msg=name)
