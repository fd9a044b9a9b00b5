"""The logged loss: each step's loss kept as a tensor until the next log point (one
accumulator on every device type: no host read per step), and the mean over the epoch's
samples, as Keras logs it."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fitdp


def test_steps_keep_their_loss_until_the_log_point_and_log_the_sample_mean():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(70, 5), torch.randint(0, 3, (70,))
    hand = copy.deepcopy(net)
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
    held: list[int] = []

    class Held(fitdp.callbacks.Callback):
        needs_batch_logs = False  # so no batch is a log point but the first (which folds)

        def on_train_batch_end(self, batch, logs=None):
            executors = model._replicas.manager.execgrp.executors  # noqa: SLF001
            held.append(sum(len(ex.pending_losses) for ex in executors))

    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, log_every=1000,
                        verbose=0, callbacks=[Held()])
    assert held == [0, 1, 2, 3, 4]  # the first batch is a log point (it folds); then kept

    # The same steps by hand: Keras's epoch loss is the mean over samples, so a short last
    # batch (6 rows) weighs by its rows.
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    total = 0.0
    for i in range(0, 70, 16):
        opt.zero_grad()
        loss = F.cross_entropy(hand(x[i:i + 16]), y[i:i + 16])
        loss.backward()
        opt.step()
        total += loss.item() * len(y[i:i + 16])
    assert history.history["loss"][0] == total / 70
    for a, b in zip(net.parameters(), hand.parameters()):
        assert torch.equal(a, b)


def test_logged_loss_on_random_device_lists_and_work_loads_is_one_devices():
    """Each CPU replica sums its slices' losses as numbers; their sum over the replicas is
    the one-device epoch loss for any devices and work loads (and the weights are its)."""
    rng = random.Random(7)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    x, y = torch.randn(90, 6), torch.randint(0, 4, (90,))
    runs = []
    configs = [(1, None)] + [
        (n, [rng.uniform(0.2, 2.0) for _ in range(n)]) for n in (2, 3, rng.randint(2, 4))]
    for n, loads in configs:
        model = fitdp.Model(copy.deepcopy(net))
        model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
        h = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, devices=["cpu"] * n,
                      work_load_list=loads, verbose=0)
        runs.append((h.history["loss"], [p.detach().clone() for p in model.module.parameters()]))
    for losses, params in runs[1:]:
        assert losses == pytest.approx(runs[0][0], rel=1e-6)
        for a, b in zip(params, runs[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
