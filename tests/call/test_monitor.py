"""Monitor: statistics of outputs, weights and gradients every `interval` batches."""

from __future__ import annotations

import math

import torch
from torch import nn

import fitdp
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager


def test_default_stat_is_rms_and_interval_is_respected():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    mon = fitdp.Monitor(2, pattern="0")
    mon.install(net)
    x = torch.randn(5, 3)
    rows = []
    for _ in range(4):
        mon.tic()
        out = net(x)
        out.sum().backward()
        rows.append(mon.toc())
    assert [len(r) for r in rows] == [5, 0, 5, 0]  # output, weight, bias, and 2 grads
    names = [name for _, name, _ in rows[0]]
    assert names == ["0_output", "0.weight", "0.weight_grad", "0.bias", "0.bias_grad"]
    expected = float(net[0](x).detach().norm() / math.sqrt(20))
    assert rows[0][0][2] == __import__("pytest").approx(expected, rel=1e-5)
    assert [step for step, _, _ in rows[2]] == [3] * 5


def test_monitor_covers_every_device_and_custom_stat():
    mgr = DataParallelExecutorManager(nn.Linear(3, 2), ["cpu", "cpu"],
                                      loss=nn.functional.cross_entropy)
    mon = fitdp.Monitor(1, stat_func=lambda t: t.abs().max(), pattern=".*", sort=True)
    mgr.install_monitor(mon)
    mon.tic()
    mgr.load_data_batch(DataBatch(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))
    mgr.forward(is_train=True)
    mgr.backward()
    names = [n for _, n, _ in mon.toc()]
    assert names == sorted(names)
    assert {"d0/module_output", "d1/module_output", "weight", "weight_grad"} <= set(names)


def test_fit_installs_and_prints(capsys):
    """Regression (issue 22.7): fit's monitor rows were silent unless INFO logging was set up,
    and had no epoch; they print through the progress bar's writer, with the epoch."""
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    model.compile(optimizer="sgd", loss="cross_entropy")
    seen = []
    mon = fitdp.Monitor(3, pattern=r"2", on_rows=seen.append)
    model.fit(torch.randn(24, 3), torch.randint(0, 2, (24,)), batch_size=4, monitor=mon,
              epochs=2, verbose=0)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch ")]
    assert len(lines) == 2 * 2 * 5  # per epoch batches 1 and 4 of 6; output, weight/bias, grads
    assert lines[0].split()[:4] == ["epoch", "1", "batch", "1"]
    assert lines[-1].split()[:4] == ["epoch", "2", "batch", "10"]
    assert any("2_output" in line for line in lines)
    assert [len(rows) for rows in seen] == [5] * 4 and mon.last == seen[-1]
    assert seen[0][0].epoch == 1 and isinstance(seen[0][0].value, float)
    silent = fitdp.Monitor(3, pattern=r"2", verbose=False)
    model.fit(torch.randn(24, 3), torch.randint(0, 2, (24,)), batch_size=4, monitor=silent,
              verbose=0)
    assert "epoch " not in capsys.readouterr().out and len(silent.last) == 5
    assert not mon._handles  # hooks removed after fit
