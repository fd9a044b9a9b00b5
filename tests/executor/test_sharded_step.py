"""ShardedStep: the optimizer step split over CPU replica threads is the full step, bit for
bit, for every optimizer it accepts."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from fitdp.executor.sharded_step import SHARDABLE, ShardedStep
from fitdp.executor.workers import DeviceWorkers


@pytest.mark.parametrize("cls", SHARDABLE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("shards", [2, 3])
def test_sharded_step_is_bitwise_the_full_step(cls, shards):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(9, 17), nn.Tanh(), nn.Linear(17, 4))
    twin = copy.deepcopy(net)
    opts = [cls(m.parameters(), lr=0.01) for m in (net, twin)]
    workers = DeviceWorkers(shards)
    sharded = ShardedStep(opts[1], shards)
    for step in range(3):
        x = torch.randn(8, 9, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((net, twin), opts):
            opt.zero_grad()
            m(x).square().mean().backward()
        opts[0].step()
        workers.run([functools.partial(sharded.step_shard, s) for s in range(shards)])
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    workers.close()


def test_unsupported_optimizers_are_not_sharded():
    opt = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    assert not ShardedStep.supports(opt)


def test_a_fit_steps_each_shard_on_its_device_thread_once_the_speed_check_is_done(monkeypatch):
    """The bound step hands a batch that steps to the device threads with their shard of the
    update (``group.tasks``), also once the first batches' timing is over."""
    import threading

    import fitdp

    threads: list[tuple[int, str]] = []
    real = ShardedStep.step_shard

    def spy(self, shard):
        threads.append((shard, threading.current_thread().name))
        return real(self, shard)

    monkeypatch.setattr(ShardedStep, "step_shard", spy)
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4)))
    model.compile(optimizer="adam", loss="cross_entropy")
    x, y = torch.randn(256, 512), torch.randint(0, 4, (256,))
    model.fit(x, y, batch_size=8, devices=["cpu", "cpu"], verbose=0)  # 32 steps
    assert len(threads) == 2 * 32
    # The check times its first 17 batches (some run every share on this thread); after it,
    # each shard steps on its own device's thread.
    late = threads[-2 * 10:]
    assert {t for s, t in late if s == 1} == {"fitdp-device-1"}
    assert {t for s, t in late if s == 0} == {threading.main_thread().name}
