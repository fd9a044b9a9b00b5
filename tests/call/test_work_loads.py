"""Model.fit(work_load_list="auto"): measured loads, reported on the model, and the update of
the whole batch whatever the split."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch
from torch import nn

import fitdp


class SlowOnDevice1(nn.Module):
    """On fitdp's device-1 thread, 0.4 ms per row: a device about a few times slower."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "fitdp-device-1":
            time.sleep(0.0004 * x.shape[0])
        return self.lin(x)


def test_fit_auto_moves_rows_off_the_slow_replica_and_reports_the_loads(caplog):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(480, 5, generator=g), torch.randint(0, 3, (480,), generator=g)
    net = SlowOnDevice1()
    ref = copy.deepcopy(net)
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
    with caplog.at_level(logging.INFO, logger="fitdp"):
        model.fit(x, y, batch_size=48, devices=["cpu", "cpu"], work_load_list="auto",
                  shuffle=False, verbose=0)
    loads = model.work_load_list
    assert loads is model._replicas.manager.work_load_list  # the list in use, kept current
    assert loads[0] > 1.5 * loads[1], loads
    assert any(str(loads) in r.getMessage() for r in caplog.records)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # the hand loop: whole batches
    for i in range(0, 480, 48):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x[i:i + 48]), y[i:i + 48]).backward()
        opt.step()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    model.fit(x, y, batch_size=48, devices=["cpu", "cpu"], verbose=0)  # fixed loads again
    assert model.work_load_list == [1.0, 1.0]
    model.close()


def test_a_misspelt_auto_names_the_argument():
    model = fitdp.Model(nn.Linear(5, 3))
    model.compile(loss="cross_entropy")
    # A string of the wrong value is a ValueError since a4448f8 (right type, wrong value).
    with pytest.raises(ValueError, match=r"work_load_list: got 'automatic'; expected 'auto'"):
        model.fit(torch.randn(8, 5), torch.randint(0, 3, (8,)), devices=["cpu", "cpu"],
                  work_load_list="automatic", verbose=0)
