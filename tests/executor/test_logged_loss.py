"""The logged loss on the CPU: each step's loss read as a number when the step ends (no tensor
kept until the log point), and still the mean over the epoch's samples, as Keras logs it."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

import fitdp


def test_cpu_steps_keep_no_loss_tensor_and_log_the_sample_mean():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(70, 5), torch.randint(0, 3, (70,))
    hand = copy.deepcopy(net)
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, log_every=1000,
                        verbose=0)
    executors = model._replicas.manager.execgrp.executors  # noqa: SLF001 - what is held
    assert all(ex.host_losses and ex.pending_losses == [] for ex in executors)

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
